"""Publishes orders with pika and prints the status messages that come back,
for tests/tests/e2e/contract.rs: the test decides what to send and checks what
was received; this program only speaks AMQP as a Python client does.

Reads one JSON object on stdin:
  url       the broker URL
  exchange  the orders exchange
  listen    queues to declare (exclusive) and read status messages from
  publish   messages to send in order, each {"body": text,
            "reply_to": property or null, "correlation_id": property or null}
  expect    how many status messages to wait for
  timeout   seconds to wait for them
  linger    seconds to go on listening after them, to catch any extra
Prints one JSON line per status message received:
  {"queue", "correlation_id", "message_id", "status"}
"""
import json, sys, time, pika

spec = json.load(sys.stdin)
connection = pika.BlockingConnection(pika.URLParameters(spec["url"]))
channel = connection.channel()
channel.confirm_delivery()
received = []


def on_status(queue):
    def handle(ch, method, properties, body):
        received.append(queue)
        print(json.dumps({"queue": queue, "correlation_id": properties.correlation_id,
                          "message_id": properties.message_id, "status": json.loads(body)}), flush=True)
    return handle


for queue in spec["listen"]:
    channel.queue_declare(queue, exclusive=True)
    channel.basic_consume(queue, on_status(queue), auto_ack=True)
for message in spec["publish"]:
    channel.basic_publish(spec["exchange"], "", message["body"].encode(), pika.BasicProperties(
        content_type="application/json", delivery_mode=2, reply_to=message.get("reply_to"),
        correlation_id=message.get("correlation_id")))
deadline = time.monotonic() + spec["timeout"]
while len(received) < spec["expect"] and time.monotonic() < deadline:
    connection.process_data_events(time_limit=0.2)
end = time.monotonic() + spec["linger"]
while time.monotonic() < end:
    connection.process_data_events(time_limit=0.2)
connection.close()
