import json, os, uuid, pika

# Compose's client user by default; AMQP_URL and AMQP_PREFIX (amqp.prefix) point elsewhere.
parameters = pika.URLParameters(os.environ.get("AMQP_URL", "amqp://sas-client:dev-client@localhost:5672/%2f"))
prefix = os.environ.get("AMQP_PREFIX", "")
channel = pika.BlockingConnection(parameters).channel()
channel.confirm_delivery()  # basic_publish raises unless the broker confirms
# A client may read only queues named <prefix>sas.client.<its user>.<anything>.
replies = channel.queue_declare(f"{prefix}sas.client.{parameters.credentials.username}.{uuid.uuid4()}",
                                exclusive=True).method.queue
order = {"schema_version": 1, "order_id": f"ord-{uuid.uuid4()}", "customer_id": "cust-42",
         "items": [{"sku": "SKU-1", "quantity": 2}], "amount_cents": 2499, "currency": "EUR"}
# user_id: RabbitMQ checks it is the user logged in; the system knows its clients by it.
channel.basic_publish(f"{prefix}sas.orders", "", json.dumps(order), pika.BasicProperties(
    content_type="application/json", delivery_mode=2, reply_to=replies, correlation_id=order["order_id"],
    user_id=parameters.credentials.username))
for _, _, body in channel.consume(replies, auto_ack=True, inactivity_timeout=60):
    if body is None:
        raise SystemExit("no answer within 60 s")
    status = json.loads(body)
    print(status["event"], status.get("step") or status.get("detail") or "")
    if status["event"] in ("processed", "compensated", "failed", "rejected"):
        raise SystemExit(0 if status["event"] == "processed" else 1)
