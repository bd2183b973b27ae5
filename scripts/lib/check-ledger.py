"""Checks remote-sim's ledger against the orders' final states.

    python3 check-ledger.py LEDGER.json STATES.txt

LEDGER.json is remote-sim's GET /side-effects; STATES.txt holds one
`order_id|state` a line (psql -A -t). Prints `entries=N duplicates=N`, then
up to 20 problems, and exits 1 if there is any:
- an idempotency key decided twice, or an effect applied twice;
- a processed order whose reserve, charge and ship were not each applied
  once, or that had anything undone;
- a compensated order with an applied action not undone exactly once;
- an undo applied before the action it undoes (remote-sim's applied_at);
- an effect for an order the database does not know (its commit was lost:
  a customer charged for an order nobody has).
Used by scripts/compose-test.sh and scripts/ha-test.sh.
"""
import collections
import json
import sys



def instant(text):
    """An RFC 3339 UTC time (chrono writes 0 to 9 fractional digits) as a sortable tuple."""
    whole, _, fraction = text.rstrip("Z").partition(".")
    return whole, fraction.ljust(9, "0")


entries = json.load(open(sys.argv[1]))
states = dict(line.strip().split("|") for line in open(sys.argv[2]) if line.strip())
applied = collections.Counter()
applied_at = {}
keys = collections.Counter(e["key"] for e in entries)
for e in entries:
    if e["decision"] == "applied":
        # The key is <order>:<step>[:undo]; our order ids hold no ':'.
        order = e.get("order_id") or e["key"].split(":")[0]
        applied[(order, e["service"], e["operation"])] += 1
        applied_at[(order, e["service"], e["operation"])] = instant(e.get("applied_at") or e["at"])
duplicates = sum(n - 1 for n in applied.values() if n > 1) + sum(n - 1 for n in keys.values() if n > 1)
problems = []
actions = [("inventory", "reserve"), ("payment", "charge"), ("shipping", "ship")]
undos = {"reserve": ("inventory", "release"), "charge": ("payment", "refund"), "ship": ("shipping", "cancel")}
for order, state in states.items():
    for service, operation in actions:
        undo = (order, *undos[operation])
        if applied[undo] and applied[(order, service, operation)]:
            if applied_at[undo] < applied_at[(order, service, operation)]:
                problems.append(f"{order}: {undo[1]}/{undo[2]} applied before {service}/{operation}")
    if state == "processed":
        for service, operation in actions:
            if applied[(order, service, operation)] != 1:
                problems.append(f"{order} processed with {service}/{operation} applied {applied[(order, service, operation)]} times")
        for service, operation in undos.values():
            if applied[(order, service, operation)]:
                problems.append(f"{order} processed but {service}/{operation} applied")
    elif state == "compensated":
        for service, operation in actions:
            undo = undos[operation]
            if applied[(order, service, operation)] and applied[(order, *undo)] != 1:
                problems.append(f"{order} compensated but {service}/{operation} not undone once")
unknown = sorted({order for (order, _, _) in applied} - set(states))
for order in unknown:
    problems.append(f"{order}: effects applied for an order the database does not know")
print(f"entries={len(entries)} duplicates={duplicates} unknown_orders={len(unknown)}")
for p in problems[:20]:
    print(p)
sys.exit(1 if duplicates or problems else 0)
