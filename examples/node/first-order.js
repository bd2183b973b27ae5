// Submits one order and prints its status messages until the outcome: the
// Node counterpart of examples/python/first_order.py, with amqplib.
//
//   npm ci && node first-order.js
//
// Compose's client user by default; AMQP_URL and AMQP_PREFIX (the
// deployment's amqp.prefix) point elsewhere. Exits 0 when the order was
// processed, 1 for another outcome (compensated, failed, rejected), 2 when
// no answer came.
'use strict';
const amqp = require('amqplib');
const { randomUUID } = require('node:crypto');

const url = process.env.AMQP_URL ?? 'amqp://sas-client:dev-client@localhost:5672/%2f';
const prefix = process.env.AMQP_PREFIX ?? '';
const TERMINAL = new Set(['processed', 'compensated', 'failed', 'rejected']);
const QUIET_MS = 60_000;

async function main() {
  const connection = await amqp.connect(url);
  // Errors also reject the awaited call they break; without a listener,
  // Node would end the process on the event instead.
  connection.on('error', (error) => console.error(`connection: ${error.message}`));
  let settle;
  try {
    const channel = await connection.createConfirmChannel();
    channel.on('error', (error) => console.error(`channel: ${error.message}`));
    const user = decodeURIComponent(new URL(url).username) || 'guest';
    // A client may read only queues named <prefix>sas.client.<its user>.<anything>.
    const { queue } = await channel.assertQueue(`${prefix}sas.client.${user}.${randomUUID()}`, {
      exclusive: true,
    });
    const outcome = new Promise((resolve, reject) => {
      let timer;
      const quiet = () => {
        clearTimeout(timer);
        timer = setTimeout(() => reject(new Error(`no answer within ${QUIET_MS / 1000} s`)), QUIET_MS);
      };
      settle = { resolve, reject, quiet, done: () => clearTimeout(timer) };
      quiet();
    });
    // Listen before publishing, so that no status can come first.
    await channel.consume(
      queue,
      (message) => {
        if (message === null) return settle.reject(new Error('the broker cancelled the consumer'));
        settle.quiet();
        const status = JSON.parse(message.content.toString());
        console.log(status.event, status.step ?? status.detail ?? '');
        if (TERMINAL.has(status.event)) {
          settle.done();
          settle.resolve(status.event);
        }
      },
      { noAck: true },
    );
    const order = {
      schema_version: 1,
      order_id: `ord-${randomUUID()}`,
      customer_id: 'cust-42',
      items: [{ sku: 'SKU-1', quantity: 2 }],
      amount_cents: 2499,
      currency: 'EUR',
    };
    channel.publish(`${prefix}sas.orders`, '', Buffer.from(JSON.stringify(order)), {
      contentType: 'application/json',
      deliveryMode: 2,
      replyTo: queue,
      correlationId: order.order_id,
      userId: user, // RabbitMQ checks it is the user logged in; the system knows its clients by it
    });
    await channel.waitForConfirms(); // throws unless the broker took the order
    process.exitCode = (await outcome) === 'processed' ? 0 : 1;
  } finally {
    settle?.done();
    await connection.close().catch(() => {});
  }
}

main().catch((error) => {
  console.error(error.message);
  process.exitCode = 2;
});
