-- row 4: seed pattern, autocommit: INSERT ... ON CONFLICT DO NOTHING RETURNING, then UPDATE
\set k random(1, 1000000000000000000)
INSERT INTO bench.seed_keys (scope, key, status, token, attempt, fingerprint, created_at, lease_until, expires_at, retention, sweep_at) VALUES (:scope, :k, 'pending', :k, 1, '\xd966b277e8317db59b077107cbb42d727f5f344e6dcd131f511c16bee9f6837c'::bytea, now(), now() + interval '30 s', now() + interval '1 day', interval '1 day', now() + interval '30 s') ON CONFLICT (scope, key) DO NOTHING RETURNING token;
UPDATE bench.seed_keys SET status = 'succeeded', response_code = 200, response_body = '{"id": 1, "ok": true}', finished_at = now(), lease_until = NULL, expires_at = now() + interval '1 day', sweep_at = now() + interval '1 day' WHERE scope = :scope AND key = :k;
