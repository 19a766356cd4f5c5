-- row 7: floor: bare INSERT of the pending row, then bare UPDATE to succeeded
-- (2 commits, no checks), on a table of the same shape with only its PK
\set k random(1, 1000000000000000000)
INSERT INTO bench.floor_keys (scope, key, status, token, attempt, fingerprint, created_at, lease_until, expires_at, retention, sweep_at) VALUES (:scope, :k, 'pending', :k, 1, '\xd966b277e8317db59b077107cbb42d727f5f344e6dcd131f511c16bee9f6837c'::bytea, now(), now() + interval '30 s', now() + interval '1 day', interval '1 day', now() + interval '30 s');
UPDATE bench.floor_keys SET status = 'succeeded', response_code = 200, response_body = '{"id": 1, "ok": true}', finished_at = now(), lease_until = NULL, expires_at = now() + interval '1 day', sweep_at = now() + interval '1 day' WHERE scope = :scope AND key = :k;
