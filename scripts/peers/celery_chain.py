"""The Celery peer of sas-bench: the same 3-step order as a Celery chain.

Run it through scripts/peers/celery-bench.sh, which makes the venv, starts
remote-sim, and makes (and removes) a RabbitMQ vhost and a Postgres
database. This file is three things:

- the Celery app and its tasks (``celery -A celery_chain worker`` imports
  it; the PEER_* environment variables configure it);
- ``python celery_chain.py bench ...``: runs every variant, each in a
  child process of its own, then prints a table and writes the JSON report;
- ``python celery_chain.py variant ...``: one variant (the child): starts
  its workers, warms up, measures saturation and latency, stops them.

The order (like sas-bench's): reserve_stock -> charge_payment ->
create_shipment, each a POST to remote-sim's /<service>/<action> with the
Idempotency-Key ``<order_id>:<step>`` and the body
``{"order": ..., "results": {<earlier steps' answers>}}``.

Variants:
- durable: persistent messages published with confirms, task_acks_late,
  task_reject_on_worker_lost, every task's result stored in Postgres
  (Celery's database backend, SQLAlchemy + psycopg2);
- rpc: result_backend = "rpc://" (results as messages to the client),
  Celery's defaults otherwise (persistent task messages, early acks).
"""

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from datetime import datetime, timezone

from celery import Celery, chain

ENV = os.environ
HERE = os.path.dirname(os.path.abspath(__file__))

# (step, service, action): the built-in order workflow of the project.
STEPS = [
    ("reserve_stock", "inventory", "reserve"),
    ("charge_payment", "payment", "charge"),
    ("create_shipment", "shipping", "ship"),
]

VARIANTS = ("durable", "rpc")


# --------------------------------------------------------------------------
# The Celery app and its tasks
# --------------------------------------------------------------------------


def build_app():
    """The app as the PEER_* variables say (the same in the client and workers)."""
    app = Celery("celery_chain")
    variant = ENV.get("PEER_VARIANT", "rpc")
    queue = ENV.get("PEER_QUEUE", "peer-celery")
    concurrency = int(ENV.get("PEER_CONCURRENCY", "16"))
    conf = {
        "broker_url": ENV.get("PEER_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//"),
        "broker_connection_retry_on_startup": True,
        # Enough producers for every worker thread (and the client's threads).
        "broker_pool_limit": max(concurrency, int(ENV.get("PEER_CLIENT_THREADS", "16"))) + 8,
        "task_default_queue": queue,
        "task_default_exchange": queue,
        "task_default_routing_key": queue,
        "task_default_delivery_mode": "persistent",
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "worker_enable_remote_control": False,
        "worker_send_task_events": False,
        "worker_prefetch_multiplier": int(ENV.get("PEER_PREFETCH_MULTIPLIER", "4")),
    }
    if ENV.get("PEER_QUORUM") == "1":
        conf["task_default_queue_type"] = "quorum"
    if variant == "durable":
        conf.update(
            {
                # psycopg2 (SQLAlchemy 2.1 would take psycopg 3 for postgresql://).
                "result_backend": "db+" + ENV.get(
                    "PEER_DB_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
                ).replace("postgresql://", "postgresql+psycopg2://", 1),
                "database_engine_options": {
                    "pool_size": concurrency + 2,
                    "max_overflow": 8,
                    # date_done is a timestamp without time zone: keep it in UTC.
                    "connect_args": {"options": "-c timezone=UTC"},
                },
                "task_acks_late": True,
                "task_reject_on_worker_lost": True,
                "broker_transport_options": {"confirm_publish": True},
            }
        )
    else:
        conf["result_backend"] = "rpc://"
    app.conf.update(conf)
    return app


app = build_app()

_local = threading.local()


class TransientError(Exception):
    """A 5xx or a broken connection: the task retries with the same key."""


class RefusedError(Exception):
    """A 4xx: the remote refused the call for good."""


def _connection():
    conn = getattr(_local, "conn", None)
    if conn is None:
        url = urllib.parse.urlsplit(ENV["PEER_SIM_URL"])
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
        _local.conn = conn
    return conn


def call_remote(service, action, key, payload):
    """POST /<service>/<action> with the idempotency key on a kept-alive
    connection (one per worker thread); the answer's JSON."""
    body = json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", "Idempotency-Key": key}
    for attempt in (1, 2):
        conn = _connection()
        try:
            conn.request("POST", f"/{service}/{action}", body, headers)
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as error:
            # A kept-alive connection the server closed: once more on a new
            # one (the key makes a repeat safe).
            conn.close()
            _local.conn = None
            if attempt == 2:
                raise TransientError(f"{service}/{action}: {error}") from error
            continue
        if response.status >= 500:
            raise TransientError(f"{service}/{action}: HTTP {response.status}")
        if response.status >= 400:
            raise RefusedError(f"{service}/{action}: HTTP {response.status}: {data[:200]!r}")
        return json.loads(data) if data else None
    raise AssertionError("unreachable")


def _step(index, payload):
    name, service, action = STEPS[index]
    order = payload["order"]
    answer = call_remote(service, action, f"{order['order_id']}:{name}", payload)
    results = dict(payload.get("results") or {})
    results[name] = answer
    return {"order": order, "results": results}


_IGNORE_INTERMEDIATE = ENV.get("PEER_IGNORE_INTERMEDIATE") == "1"
_TASK_OPTIONS = {
    "autoretry_for": (TransientError,),
    "retry_kwargs": {"max_retries": 5, "countdown": 0.2},
}


@app.task(name="peer.reserve_stock", ignore_result=_IGNORE_INTERMEDIATE, **_TASK_OPTIONS)
def reserve_stock(order):
    return _step(0, {"order": order, "results": {}})


@app.task(name="peer.charge_payment", ignore_result=_IGNORE_INTERMEDIATE, **_TASK_OPTIONS)
def charge_payment(previous):
    return _step(1, previous)


@app.task(name="peer.create_shipment", **_TASK_OPTIONS)
def create_shipment(previous):
    return _step(2, previous)


def order_body(order_id):
    """The order sas-bench submits (sas_lab::order)."""
    return {
        "schema_version": 1,
        "order_id": order_id,
        "customer_id": "cust-1",
        "items": [{"sku": "SKU-1", "quantity": 1}],
        "amount_cents": 1999,
        "currency": "EUR",
    }


def order_chain(order_id, reply_to=None):
    """The order as a chain whose last task's id is the order id."""
    signatures = [
        reserve_stock.s(order_body(order_id)),
        charge_payment.s(),
        create_shipment.s().set(task_id=order_id),
    ]
    if reply_to:
        for signature in signatures:
            signature.set(reply_to=reply_to)
    return chain(*signatures)


# --------------------------------------------------------------------------
# Measuring: CPU from /proc, percentiles
# --------------------------------------------------------------------------

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid):
    """(comm, ppid, cpu seconds) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    open_, close = stat.find("("), stat.rfind(")")
    fields = stat[close + 1 :].split()
    # After comm: state ppid ...; utime and stime are the 14th and 15th fields.
    return stat[open_ + 1 : close], int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS


def cpu_sample(worker_pids, sim_pid):
    """CPU seconds used so far, by program: the celery workers (and their
    children), this client, remote-sim, and every beam.smp (RabbitMQ) and
    postgres process of the machine (as sas-bench counts them)."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = _stat(int(name))
            if s:
                stats[int(name)] = s
    children = {}
    for pid, (_, ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    workers, todo = set(), list(worker_pids)
    while todo:
        pid = todo.pop()
        if pid in workers or pid not in stats:
            continue
        workers.add(pid)
        todo.extend(children.get(pid, []))
    out = {"celery-workers": 0.0, "client": 0.0, "remote-sim": 0.0, "rabbitmq": 0.0, "postgres": 0.0}
    me = os.getpid()
    for pid, (comm, _, secs) in stats.items():
        if pid in workers:
            out["celery-workers"] += secs
        elif pid == me:
            out["client"] += secs
        elif pid == sim_pid:
            out["remote-sim"] += secs
        elif comm == "beam.smp":
            out["rabbitmq"] += secs
        elif comm == "postgres":
            out["postgres"] += secs
    return out


def cpu_ms_per_order(before, after, orders):
    per = {k: (after[k] - before.get(k, 0.0)) * 1000.0 / orders for k in after}
    per["total"] = sum(per.values())
    return per


def percentiles(samples):
    """p50, p95, p99 as sas-bench's report.rs computes them."""
    if not samples:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    s = sorted(samples)

    def at(q):
        return s[int(round((len(s) - 1) * q))]

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99)}


def sim_request(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(ENV["PEER_SIM_URL"] + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read()
    return json.loads(text) if text else None


# --------------------------------------------------------------------------
# Seeing chains finish: the last task's result
# --------------------------------------------------------------------------


class DbTracker:
    """Durable variant: the last task's row in celery_taskmeta. A chain ends
    when its last result is stored (date_done, written by the worker); a
    client polling the table would see it one poll later."""

    def __init__(self):
        import psycopg2

        self.conn = psycopg2.connect(ENV["PEER_DB_URL"], options="-c timezone=UTC")
        self.conn.autocommit = True
        self.submitted = {}  # id -> submit time (epoch)
        self.publish_secs = {}  # id -> how long apply_async took (confirm included)
        self.lock = threading.Lock()

    def start_consuming(self):
        pass

    def submit(self, order_id):
        at = time.time()
        order_chain(order_id).apply_async()
        took = time.time() - at
        with self.lock:
            self.submitted[order_id] = at
            self.publish_secs[order_id] = took

    def _ended(self, ids):
        """{id: (status, date_done epoch)} of those of ids whose last task ended."""
        with self.conn.cursor() as cur:
            cur.execute(
                "SELECT task_id, status, extract(epoch FROM date_done)::float8 FROM celery_taskmeta "
                "WHERE task_id = ANY(%s) AND status IN ('SUCCESS', 'FAILURE')",
                (list(ids),),
            )
            return {row[0]: (row[1], row[2]) for row in cur.fetchall()}

    def _one_ended(self, order_id):
        with self.conn.cursor() as cur:
            cur.execute(
                "SELECT 1 FROM celery_taskmeta WHERE task_id = %s AND status IN ('SUCCESS', 'FAILURE')",
                (order_id,),
            )
            return cur.fetchone() is not None

    def wait_all(self, ids, timeout):
        """Like sas-bench's wait_processed: the last id every 10 ms, all of
        them once that one has ended or once a second. {id: (status, end)}."""
        deadline = time.time() + timeout
        last_count = time.time()
        while True:
            if self._one_ended(ids[-1]) or time.time() - last_count >= 1.0:
                last_count = time.time()
                ended = self._ended(ids)
                if len(ended) >= len(ids):
                    return ended
                if time.time() > deadline:
                    raise RuntimeError(f"only {len(ended)} of {len(ids)} chains ended within {timeout} s")
            time.sleep(0.01)

    def saturate(self, ids, threads):
        """Offers every chain as fast as `threads` publishers with confirms can."""
        it = iter(ids)
        lock = threading.Lock()

        def publisher():
            while True:
                with lock:
                    order_id = next(it, None)
                if order_id is None:
                    return
                self.submit(order_id)

        workers = [threading.Thread(target=publisher, daemon=True) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def paced(self, ids, rate, threads, timeout):
        """Offers ids at `rate`/s; {id: (status, end epoch, seen epoch)}."""
        started = time.monotonic()
        next_index = [0]
        lock = threading.Lock()

        def publisher():
            while True:
                with lock:
                    i = next_index[0]
                    next_index[0] += 1
                if i >= len(ids):
                    return
                delay = started + i / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                self.submit(ids[i])

        workers = [threading.Thread(target=publisher, daemon=True) for _ in range(threads)]
        for w in workers:
            w.start()
        # Poll the chains submitted and not yet ended every 10 ms.
        ended = {}
        deadline = time.time() + timeout + len(ids) / rate
        while len(ended) < len(ids):
            with self.lock:
                upto = min(next_index[0], len(ids))
                pending = [i for i in ids[:upto] if i in self.submitted and i not in ended]
            if pending:
                seen = time.time()
                for order_id, (status, end) in self._ended(pending).items():
                    ended[order_id] = (status, end, seen)
            if time.time() > deadline:
                raise RuntimeError(f"only {len(ended)} of {len(ids)} chains ended in time")
            time.sleep(0.01)
        for w in workers:
            w.join()
        return ended


class RpcTracker:
    """rpc variant: every result comes to this client's reply queue; a
    chain ends when its last task's result arrives. One thread does it
    all: the rpc backend's reply queue is per thread."""

    def __init__(self):
        self.submitted = {}
        self.publish_secs = {}
        self.ended = {}  # id -> (status, arrival epoch)
        self.waiting = set()
        self.backend = app.backend
        self.oid = self.backend.oid
        self.consumer = self.backend.result_consumer

    def _on_message(self, meta):
        # Every result (the chain's first two tasks' too) passes here.
        if meta.get("status") in ("SUCCESS", "FAILURE"):
            task_id = meta.get("task_id")
            if task_id in self.submitted and task_id not in self.ended:
                self.ended[task_id] = (meta["status"], time.time())
                self.waiting.discard(task_id)

    def start_consuming(self):
        # Consume from this thread's reply queue (one for every task id).
        self.consumer.consume_from("peer-start")
        self.consumer.on_message = self._on_message

    def submit(self, order_id):
        at = time.time()
        order_chain(order_id, reply_to=self.oid).apply_async()
        self.publish_secs[order_id] = time.time() - at
        self.submitted[order_id] = at

    def drain(self, timeout):
        """One event within timeout; False when none came."""
        try:
            self.consumer.drain_events(timeout=timeout)
            return True
        except socket.timeout:
            return False

    def drain_ready(self):
        """What has arrived already, without waiting."""
        for _ in range(10_000):
            if not self.drain(0.0001):
                return

    def wait_all(self, ids, timeout):
        deadline = time.time() + timeout
        self.waiting = {i for i in ids if i not in self.ended}
        while self.waiting:
            if time.time() > deadline:
                raise RuntimeError(f"only {len(ids) - len(self.waiting)} of {len(ids)} chains ended within {timeout} s")
            self.drain(0.05)
        return {i: self.ended[i] for i in ids}

    def saturate(self, ids, threads):
        for n, order_id in enumerate(ids):
            self.submit(order_id)
            if n % 16 == 15:
                self.drain_ready()

    def paced(self, ids, rate, threads, timeout):
        started = time.monotonic()
        for i, order_id in enumerate(ids):
            while True:
                delay = started + i / rate - time.monotonic()
                if delay <= 0:
                    break
                self.drain(min(delay, 0.05))
            self.submit(order_id)
        self.wait_all(ids, timeout)
        return {i: self.ended[i] + (self.ended[i][1],) for i in ids}


# --------------------------------------------------------------------------
# One variant (a child process of its own)
# --------------------------------------------------------------------------


def wait_for_consumers(queue, count, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with app.connection_for_write() as conn:
                _, _, consumers = conn.default_channel.queue_declare(queue=queue, passive=True)
                if consumers >= count:
                    return
        except Exception:  # the queue is not declared yet
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the workers did not consume from {queue} within {timeout} s")


def start_workers(args, log_dir):
    celery = os.path.join(os.path.dirname(sys.executable), "celery")
    workers = []
    for k in range(args.workers):
        command = [
            celery, "-A", "celery_chain", "worker",
            "--pool", args.pool, "--concurrency", str(args.concurrency),
            "-Q", ENV["PEER_QUEUE"], "-n", f"peer{k}-{ENV['PEER_VARIANT']}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "--loglevel", "WARNING",
        ]
        log = open(os.path.join(log_dir, f"celery-{ENV['PEER_VARIANT']}-{k}.log"), "ab")
        workers.append(subprocess.Popen(command, cwd=HERE, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    return workers


def stop_workers(workers):
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    deadline = time.time() + 20
    for w in workers:
        try:
            w.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


def delete_queue(queue):
    try:
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue=queue)
            conn.default_channel.exchange_delete(exchange=queue)
    except Exception as error:  # noqa: BLE001
        print(f"celery-bench: could not delete queue {queue}: {error}", file=sys.stderr)


def run_variant(args):
    variant = ENV["PEER_VARIANT"]
    tag = ENV.get("PEER_RUN_TAG", str(os.getpid()))
    sim_pid = args.sim_pid
    if variant == "durable":
        # The tables, once, before several workers race to create them.
        session = app.backend.ResultSession()
        session.close()
        tracker = DbTracker()
    else:
        tracker = RpcTracker()
    workers = start_workers(args, args.log_dir)
    report = {"variant": variant, "pool": args.pool, "concurrency": args.concurrency, "workers": args.workers}
    try:
        wait_for_consumers(ENV["PEER_QUEUE"], args.workers, 60)
        worker_pids = [w.pid for w in workers]

        def ids(prefix, n):
            return [f"{tag}-{variant}-{prefix}-{i}" for i in range(n)]

        # Warm-up (as sas-bench: a few orders, so nothing measures a cold start).
        tracker.start_consuming()
        warm = ids("warmup", 20)
        tracker.saturate(warm, args.client_threads)
        tracker.wait_all(warm, 120)
        time.sleep(0.5)

        # Saturation.
        sat = ids("sat", args.orders)
        calls_before = sim_request("GET", "/stats")["calls"]
        cpu_before = cpu_sample(worker_pids, sim_pid)
        started = time.time()
        tracker.saturate(sat, args.client_threads)
        ended = tracker.wait_all(sat, 900)
        cpu_after = cpu_sample(worker_pids, sim_pid)
        finished = max(end for _, end in ended.values())
        report["saturation_orders"] = len(sat)
        report["saturation_secs"] = finished - started
        report["orders_per_sec"] = len(sat) / (finished - started)
        report["cpu_ms_per_order"] = cpu_ms_per_order(cpu_before, cpu_after, len(sat))
        report["failed_chains"] = sum(1 for status, _ in ended.values() if status != "SUCCESS")
        report["sim_calls_per_order"] = (sim_request("GET", "/stats")["calls"] - calls_before) / len(sat)
        time.sleep(1.0)

        # Latency at half the saturation rate (or --latency-rate).
        rate = args.latency_rate or max(report["orders_per_sec"] / 2.0, 1.0)
        count = max(int(rate * args.latency_secs), 30)
        lat = ids("lat", count)
        cpu_before = cpu_sample(worker_pids, sim_pid)
        # A few publishers are enough at half the rate (each waits for its
        # confirms, a few ms); many would contend for the GIL.
        ended = tracker.paced(lat, rate, min(args.client_threads, 4), 300)
        cpu_after = cpu_sample(worker_pids, sim_pid)
        samples = [(end - tracker.submitted[i]) * 1000.0 for i, (_, end, _) in ended.items()]
        seen = [(s - tracker.submitted[i]) * 1000.0 for i, (_, _, s) in ended.items()]
        report["latency_rate_orders_per_sec"] = rate
        report["latency_orders"] = count
        report["latency_ms"] = percentiles(samples)
        report["latency_mean_ms"] = sum(samples) / len(samples)
        if variant == "durable":
            # What a client polling the table every 10 ms saw.
            report["latency_seen_by_poller_ms"] = percentiles(seen)
        report["latency_publish_ms"] = percentiles([tracker.publish_secs[i] * 1000.0 for i in lat])
        # Each chain as [sent, ms], seconds from the first submit, in the
        # order sent (sas-bench's latency_timeline): a stall bunches the tail.
        first = min(tracker.submitted[i] for i in lat)
        report["latency_timeline"] = sorted(
            [round(tracker.submitted[i] - first, 4), round((end - tracker.submitted[i]) * 1000.0, 2)]
            for i, (_, end, _) in ended.items()
        )
        report["latency_cpu_ms_per_order"] = cpu_ms_per_order(cpu_before, cpu_after, count)
        report["latency_failed_chains"] = sum(1 for status, _, _ in ended.values() if status != "SUCCESS")
    finally:
        stop_workers(workers)
        delete_queue(ENV["PEER_QUEUE"])
    return report


# --------------------------------------------------------------------------
# The whole run: every variant, the table, the JSON
# --------------------------------------------------------------------------


def sas_figures(path):
    """sas-bench's own figures, when target/bench/latest.json is there."""
    try:
        with open(path) as f:
            latest = json.load(f)
    except (OSError, ValueError):
        return None
    cpu = latest.get("cpu_ms_per_order") or {}
    return {
        "file": path,
        "written": datetime.fromtimestamp(os.path.getmtime(path), timezone.utc).isoformat(timespec="seconds"),
        "quick": latest.get("quick"),
        "orders_per_sec": latest.get("orders_per_sec"),
        "cpu_ms_per_order_total": sum(cpu.values()) if cpu else None,
        "cpu_ms_per_order": cpu,
        "latency_rate_orders_per_sec": latest.get("latency_rate_orders_per_sec"),
        "latency_ms": latest.get("latency_ms"),
    }


def table(report):
    variants = report["variants"]
    names = list(variants)
    cols = [f"celery {n}" for n in names]
    sas = report.get("sas")
    if sas:
        cols.append("sas (latest.json)")
    rows = []

    def add(label, values):
        rows.append((label, values))

    def fmt(v, spec="{:.0f}"):
        return "-" if v is None else spec.format(v)

    sat = [variants[n].get("orders_per_sec") for n in names]
    cpu = [variants[n].get("cpu_ms_per_order", {}) for n in names]
    lat = [variants[n].get("latency_ms", {}) for n in names]
    extra = [sas] if sas else []
    add("worker pool x concurrency, processes", [
        f"{variants[n].get('pool')} x{variants[n].get('concurrency')}, {variants[n].get('workers')}"
        if "pool" in variants[n] else "-" for n in names] + ["" for _ in extra])
    add("saturation (orders/s, 3 steps)", [fmt(v) for v in sat] + [fmt(s.get("orders_per_sec")) for s in extra])
    add("cpu ms/order, all processes", [fmt(c.get("total"), "{:.2f}") for c in cpu] + [fmt(s.get("cpu_ms_per_order_total"), "{:.2f}") for s in extra])
    for part in ("celery-workers", "client", "remote-sim", "rabbitmq", "postgres"):
        add(f"  {part}", [fmt(c.get(part), "{:.2f}") for c in cpu] + ["" for _ in extra])
    add("latency rate (orders/s)", [fmt(variants[n].get("latency_rate_orders_per_sec")) for n in names] + [fmt(s.get("latency_rate_orders_per_sec")) for s in extra])
    add("latency p50 / p99 (ms)", [f"{fmt(l.get('p50'), '{:.1f}')} / {fmt(l.get('p99'), '{:.1f}')}" for l in lat] + [f"{fmt((s.get('latency_ms') or {}).get('p50'), '{:.1f}')} / {fmt((s.get('latency_ms') or {}).get('p99'), '{:.1f}')}" for s in extra])
    errors = [variants[n].get("error") for n in names]
    if any(errors):
        add("error", [e or "" for e in errors] + ["" for _ in extra])
    add("failed chains", [str(variants[n].get("failed_chains", "-")) for n in names] + ["" for _ in extra])
    width = max(len(r[0]) for r in rows) + 2
    colw = max(max(len(c) for c in cols), 14) + 2
    out = []
    title = f"celery peer benchmark (Celery {report['celery_version']}, {report['cores']} cores, "
    title += f"remote-sim latency {report['settings']['sim_latency_ms']} ms)"
    if report["quick"]:
        title += " -- QUICK: a smoke run, not a measurement"
    out.append(title)
    out.append(" " * width + "".join(c.rjust(colw) for c in cols))
    for label, values in rows:
        out.append(label.ljust(width) + "".join(v.rjust(colw) for v in values))
    if sas:
        out.append(f"sas: from {sas['file']} (written {sas['written']}{', quick' if sas.get('quick') else ''}; "
                   "run scripts/bench.sh in the same sitting to compare)")
    return "\n".join(out)


# Celery's best on this 2-core machine, from quick trials (see
# docs/performance.md): the database backend pools its connections only in
# forked pool children (under the threads pool it opens a new engine and
# connection for every result it stores: 27 chains/s against 61 with
# prefork), so durable runs prefork: 4 children, 2 a core, in one worker.
# rpc stores nothing in Postgres, and threads cost less CPU than prefork's
# parent-to-child pipes: 2 worker processes (the GIL allows a core each)
# of 16 threads.
DEFAULT_POOL = {"durable": ("prefork", 4, 1), "rpc": ("threads", 16, 2)}


def pool_of(args, variant):
    """(pool, concurrency, workers) of a variant: the options, else its default."""
    pool, concurrency, workers = DEFAULT_POOL[variant]
    if args.pool and args.pool != pool:
        pool = args.pool
        concurrency, workers = {"prefork": (4, 1), "threads": (16, 2), "gevent": (64, 2), "solo": (1, 2)}[pool]
    return pool, args.concurrency or concurrency, args.workers or workers


def run_bench(args, passthrough):
    import celery as celery_module

    if args.sim_latency_ms is not None:
        sim_request("PUT", "/admin/faults", {
            "latency_ms": args.sim_latency_ms, "transient_fault_rate": 0.0,
            "permanent_fault_rate": 0.0, "hang_rate": 0.0,
        })
    report = {
        "peer": "celery",
        "celery_version": celery_module.__version__,
        "python": sys.version.split()[0],
        "quick": args.quick,
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "settings": {
            "pool": {v: dict(zip(("pool", "concurrency", "workers"), pool_of(args, v))) for v in VARIANTS},
            "prefetch_multiplier": args.prefetch_multiplier,
            "client_threads": args.client_threads,
            "queue_type": "quorum" if args.quorum else "classic",
            "ignore_intermediate_results": args.ignore_intermediate_results,
            "sim_latency_ms": args.sim_latency_ms or 0,
            "saturation_orders": args.orders,
            "latency_secs": args.latency_secs,
        },
        "variants": {},
    }
    tag = f"p{os.getpid()}"
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            sys.exit(f"celery-bench: unknown variant {variant!r} (durable, rpc)")
        pool, concurrency, workers = pool_of(args, variant)
        print(f"celery-bench: {variant}: {workers} worker process(es), pool {pool} x{concurrency}, "
              f"{args.orders} orders at saturation, then {args.latency_secs} s at half of it", flush=True)
        env = dict(ENV)
        env.update({
            "PEER_VARIANT": variant,
            "PEER_QUEUE": f"{args.queue_prefix}{variant}",
            "PEER_CONCURRENCY": str(concurrency),
            "PEER_CLIENT_THREADS": str(args.client_threads),
            "PEER_PREFETCH_MULTIPLIER": str(args.prefetch_multiplier),
            "PEER_QUORUM": "1" if args.quorum else "0",
            "PEER_IGNORE_INTERMEDIATE": "1" if args.ignore_intermediate_results else "0",
            "PEER_RUN_TAG": tag,
        })
        out = os.path.join(args.log_dir, f"variant-{variant}.json")
        command = [sys.executable, os.path.abspath(__file__), "variant", "--out", out] + passthrough
        command += ["--pool", pool, "--concurrency", str(concurrency), "--workers", str(workers)]
        child = subprocess.run(command, env=env, cwd=HERE)
        if child.returncode != 0:
            report["variants"][variant] = {"error": f"exit {child.returncode} (logs in {args.log_dir})"}
            continue
        with open(out) as f:
            report["variants"][variant] = json.load(f)
    report["sas"] = sas_figures(args.sas_report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(table(report))
    print(f"report written to {args.out}")
    return 0 if all("error" not in v for v in report["variants"].values()) else 1


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["bench", "variant"])
    p.add_argument("--quick", action="store_true", help="a tiny run (a smoke test, ~30 s)")
    p.add_argument("--out", default="target/bench/peers.json")
    p.add_argument("--variants", default="durable,rpc")
    p.add_argument("--pool", choices=["threads", "prefork", "gevent", "solo"],
                   help="worker pool for every variant (default: prefork for durable, threads for rpc)")
    p.add_argument("--concurrency", type=int,
                   help="tasks at once per worker process (default: 4 prefork children, 16 threads)")
    p.add_argument("--workers", type=int,
                   help="celery worker processes (default: 1 with prefork, 2 with threads)")
    p.add_argument("--prefetch-multiplier", type=int, default=4)
    p.add_argument("--client-threads", type=int, default=16,
                   help="publishing threads of the durable client (each waits for its confirms)")
    p.add_argument("--orders", type=int, help="chains in the saturation phase (5000; 150 with --quick)")
    p.add_argument("--latency-secs", type=float, help="seconds of paced load (8; 2 with --quick)")
    p.add_argument("--latency-rate", type=float, help="orders/s of the latency phase (half the saturation rate)")
    p.add_argument("--sim-latency-ms", type=int, help="remote-sim latency per call (sas-bench's default: 0)")
    p.add_argument("--quorum", action="store_true", help="quorum task queues (Celery's default is classic)")
    p.add_argument("--ignore-intermediate-results", action="store_true",
                   help="reserve and charge store no result (only the chain's end does)")
    p.add_argument("--sim-pid", type=int, default=int(ENV.get("PEER_SIM_PID", "0")))
    p.add_argument("--queue-prefix", default=ENV.get("PEER_QUEUE_PREFIX", "peer-celery-"))
    p.add_argument("--log-dir", default=ENV.get("PEER_LOG_DIR", "target/peers/run"))
    p.add_argument("--sas-report", default="target/bench/latest.json")
    return p


def main(argv):
    args = parser().parse_args(argv)
    if args.orders is None:
        args.orders = 150 if args.quick else 5000
    if args.latency_secs is None:
        args.latency_secs = 2.0 if args.quick else 8.0
    args.log_dir = os.path.abspath(args.log_dir)
    args.out = os.path.abspath(args.out)
    args.sas_report = os.path.abspath(args.sas_report)
    os.makedirs(args.log_dir, exist_ok=True)
    if args.mode == "bench":
        passthrough = [a for a in argv if a != "bench"]
        # The child's --out is its own; drop the bench's.
        cleaned, skip = [], False
        for a in passthrough:
            if skip:
                skip = False
                continue
            if a == "--out":
                skip = True
                continue
            if a.startswith("--out="):
                continue
            cleaned.append(a)
        cleaned += ["--log-dir", args.log_dir]
        return run_bench(args, cleaned)
    report = run_variant(args)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
