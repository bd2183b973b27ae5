"""Checks that every order the broker confirmed is stored, fault by fault.

    python3 check-confirmed.py CONFIRMED.tsv STATES.txt FAULTS.tsv

CONFIRMED.tsv holds `order_id<TAB>unix time` a line for each order the
publisher saw confirmed (scripts/lib/publish-orders.py, CONFIRMED);
STATES.txt holds one `order_id|state` a line (psql -A -t); FAULTS.tsv holds
`name<TAB>start<TAB>end` a line. Prints, for each fault,
`start<TAB>confirmed<TAB>lost<TAB>name`: the orders confirmed between its
start and the next fault's (or the end), and how many of them the database
does not hold; then `confirmed=N lost=N` and up to 20 lost ids. Exits 1 if
any confirmed order is lost. Used by
scripts/ha-test.sh: "orders complete again" after a fault says nothing of
the orders that vanished.
"""
import sys

confirmed = []
for line in open(sys.argv[1]):
    if line.strip():
        order_id, at = line.rstrip("\n").split("\t")
        confirmed.append((float(at), order_id))
stored = {line.split("|")[0] for line in open(sys.argv[2]) if line.strip()}
faults = []
for line in open(sys.argv[3]):
    if line.strip():
        name, start, end = line.rstrip("\n").split("\t")
        faults.append((float(start), start, name))
faults.sort()
lost = [(at, order_id) for at, order_id in confirmed if order_id not in stored]
for index, (start, text, name) in enumerate(faults):
    until = faults[index + 1][0] if index + 1 < len(faults) else float("inf")
    window = [order_id for at, order_id in confirmed if start <= at < until]
    missing = [order_id for at, order_id in lost if start <= at < until]
    print(f"{text}\t{len(window)}\t{len(missing)}\t{name}")
print(f"confirmed={len(confirmed)} lost={len(lost)}")
for at, order_id in lost[:20]:
    print(f"lost: {order_id} (confirmed at {at:.3f})")
sys.exit(1 if lost else 0)
