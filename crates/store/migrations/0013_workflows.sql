-- Several workflows: each order records the version of the workflow it
-- started with, and each step keeps how its requests are shaped (the
-- method, path and body templates of its action and compensation, NULL for
-- the default call), as part of the plan the order keeps.
ALTER TABLE order_process ADD COLUMN workflow_version integer NOT NULL DEFAULT 1;
ALTER TABLE steps ADD COLUMN request jsonb;
