-- What each registered workflow version's orders' attributes must match
-- (its JSON Schema; NULL: anything), so that the gateway refuses at once
-- (400, naming the path) an order intake would refuse later, without
-- reading the schedulers' workflow files.
ALTER TABLE workflow_plans ADD COLUMN attributes_schema jsonb;
