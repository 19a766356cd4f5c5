-- row 22 floor: row 15a's batch of :batch fresh keys without the checks: one
-- bare INSERT ... SELECT of the pending rows, the business rows, the batch set
-- to succeeded, one commit.  The finish is an INSERT ... ON CONFLICT DO UPDATE
-- of the same keys: each row found by a primary-key probe whatever the
-- planner's estimates (an UPDATE ... WHERE key = ANY (...) of a per-run scope
-- is planned from a table that was empty at ANALYZE, and can scan the scope)
\set k random(1, 1000000000000000000)
BEGIN;
INSERT INTO bench.floor_keys (scope, key, status, token, attempt, fingerprint, created_at, lease_until, expires_at, retention, sweep_at) SELECT :scope, :k || '-' || g, 'pending', g, 1, '\xd966b277e8317db59b077107cbb42d727f5f344e6dcd131f511c16bee9f6837c'::bytea, now(), now() + interval '30 s', now() + interval '1 day', interval '1 day', now() + interval '30 s' FROM generate_series(1, :batch::int) g;
INSERT INTO bench.orders (scope, key, amount) SELECT :scope, :k || '-' || g, 100 FROM generate_series(1, :batch::int) g;
INSERT INTO bench.floor_keys (scope, key, status, token, attempt, fingerprint, response_code, response_body, created_at, finished_at, expires_at, retention, sweep_at) SELECT :scope, :k || '-' || g, 'succeeded', g, 1, '\xd966b277e8317db59b077107cbb42d727f5f344e6dcd131f511c16bee9f6837c'::bytea, 200, '{"id": 1, "ok": true}', now(), now(), now() + interval '1 day', interval '1 day', now() + interval '1 day' FROM generate_series(1, :batch::int) g ON CONFLICT (scope, key) DO UPDATE SET status = excluded.status, response_code = excluded.response_code, response_body = excluded.response_body, finished_at = excluded.finished_at, lease_until = NULL, expires_at = excluded.expires_at, sweep_at = excluded.sweep_at;
COMMIT;
