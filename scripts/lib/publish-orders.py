"""Publishes orders the README's way, for scripts/compose-test.sh and scripts/ha-test.sh.

    AMQP_URLS="amqp://... [amqp://...]" python3 publish-orders.py PREFIX COUNT RATE DECLINED PROGRESS

Publishes COUNT orders PREFIX-<n> (COUNT 0: until SIGTERM) to the exchange
sas.orders with pika, persistent and confirmed, RATE a second (0: as fast
as confirmed), every DECLINED-th one (0: none) with an amount the payment
service declines, and keeps the number confirmed in the file PROGRESS. When
a broker node goes away it connects to the next URL of AMQP_URLS (round
robin, for 120 s at most) and publishes the unconfirmed order again: intake
is idempotent on the order id, so a repeat is a no-op. With CONFIRMED set
to a file, it also appends `order_id<TAB>unix time` there for each order
the broker confirmed: what the end of a run checks is stored
(scripts/lib/check-confirmed.py).
"""
import json
import os
import signal
import sys
import time

import pika

prefix, count, rate, declined, progress = (
    sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
urls = os.environ["AMQP_URLS"].split()
confirmed_log = open(os.environ["CONFIRMED"], "a") if os.environ.get("CONFIRMED") else None
# user_id: the system knows a client by it (RabbitMQ checks it is the user
# logged in; every URL names the same user).
properties = pika.BasicProperties(content_type="application/json", delivery_mode=2,
                                  user_id=pika.URLParameters(urls[0]).credentials.username)
stopping = False


def stop(*_):
    global stopping
    stopping = True


signal.signal(signal.SIGTERM, stop)
node = 0


def connect():
    global node
    deadline = time.monotonic() + 120
    while True:
        parameters = pika.URLParameters(urls[node % len(urls)])
        parameters.blocked_connection_timeout = 10
        parameters.socket_timeout = 5
        try:
            channel = pika.BlockingConnection(parameters).channel()
            channel.confirm_delivery()
            return channel
        except (pika.exceptions.AMQPError, OSError) as error:
            node += 1
            if time.monotonic() > deadline:
                sys.exit(f"publisher: no broker for 120 s: {error!r}")
            time.sleep(0.2)


def report(confirmed):
    with open(progress + ".new", "w") as file:
        file.write(str(confirmed))
    os.replace(progress + ".new", progress)


channel, reconnects, i, started = connect(), 0, 0, time.monotonic()
while (count == 0 or i < count) and not stopping:
    if rate > 0:
        # Load shaping, not waiting for a condition: order i leaves at i / rate.
        time.sleep(max(0.0, started + i / rate - time.monotonic()))
    order = {"schema_version": 1, "order_id": f"{prefix}-{i}", "customer_id": "cust-42",
             "items": [{"sku": "SKU-1", "quantity": 2}], "amount_cents": 2499, "currency": "EUR"}
    if declined and i % declined == declined - 1:
        order["amount_cents"] = 5_000_000  # over remote-sim's decline_above_cents
    try:
        channel.basic_publish("sas.orders", "", json.dumps(order), properties)
    except (pika.exceptions.AMQPError, OSError) as error:
        print(f"publisher: {error!r} at order {i}: reconnecting", flush=True)
        node += 1
        channel, reconnects = connect(), reconnects + 1
        continue
    if confirmed_log:
        confirmed_log.write(f"{order['order_id']}\t{time.time():.3f}\n")
        confirmed_log.flush()
    i += 1
    report(i)
print(f"{i} orders confirmed, {reconnects} reconnections", flush=True)
