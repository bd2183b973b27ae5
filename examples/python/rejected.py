"""A refused order is answered: publish an order with a field the system does
not know, and read the `rejected` status (with the reason) on the reply_to
queue. Same settings as first_order.py."""
import json, os, uuid, pika

parameters = pika.URLParameters(os.environ.get("AMQP_URL", "amqp://sas-client:dev-client@localhost:5672/%2f"))
prefix = os.environ.get("AMQP_PREFIX", "")
channel = pika.BlockingConnection(parameters).channel()
channel.confirm_delivery()
replies = channel.queue_declare(f"{prefix}sas.client.{parameters.credentials.username}.{uuid.uuid4()}",
                                exclusive=True).method.queue
order = {"schema_version": 1, "order_id": f"ord-{uuid.uuid4()}", "customer_id": "cust-42",
         "items": [{"sku": "SKU-1", "quantity": 2}], "amount_cents": 2499, "currency": "EUR",
         "colour": "red"}  # not a field of SubmitOrder: the order is refused
channel.basic_publish(f"{prefix}sas.orders", "", json.dumps(order), pika.BasicProperties(
    content_type="application/json", delivery_mode=2, reply_to=replies, correlation_id="my-request-1",
    user_id=parameters.credentials.username))
for _, properties, body in channel.consume(replies, auto_ack=True, inactivity_timeout=60):
    if body is None:
        raise SystemExit("no answer within 60 s")
    status = json.loads(body)
    print(status["event"], properties.correlation_id, status["order_id"], status.get("detail", ""))
    if status["event"] == "rejected":
        break  # the order was not stored: fix it and send it again
    raise SystemExit(f"expected rejected, got {status['event']}")
