-- row 24's second floor: row 7 on a table that also has an index on sweep_at,
-- like idempotency.keys.  The UPDATE leaves sweep_at alone, as idem_finish
-- does (the sweeper moves it later), so that it stays a HOT update.
\set k random(1, 1000000000000000000)
INSERT INTO bench.floor_sweep_keys (scope, key, status, token, attempt, fingerprint, created_at, lease_until, expires_at, retention, sweep_at) VALUES (:scope, :k, 'pending', :k, 1, '\xd966b277e8317db59b077107cbb42d727f5f344e6dcd131f511c16bee9f6837c'::bytea, now(), now() + interval '30 s', now() + interval '1 day', interval '1 day', now() + interval '30 s');
UPDATE bench.floor_sweep_keys SET status = 'succeeded', response_code = 200, response_body = '{"id": 1, "ok": true}', finished_at = now(), lease_until = NULL, expires_at = now() + interval '1 day' WHERE scope = :scope AND key = :k;
