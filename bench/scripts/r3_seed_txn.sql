-- row 3: seed pattern, one transaction: INSERT ... ON CONFLICT DO NOTHING,
-- SELECT ... FOR UPDATE, the same business INSERT as row 2, UPDATE, COMMIT
\set k random(1, 1000000000000000000)
BEGIN;
INSERT INTO bench.seed_keys (scope, key, status, token, attempt, fingerprint, created_at, lease_until, expires_at, retention, sweep_at) VALUES (:scope, :k, 'pending', :k, 1, '\xd966b277e8317db59b077107cbb42d727f5f344e6dcd131f511c16bee9f6837c'::bytea, now(), now() + interval '30 s', now() + interval '1 day', interval '1 day', now() + interval '30 s') ON CONFLICT (scope, key) DO NOTHING;
SELECT status, fingerprint, response_code, response_body FROM bench.seed_keys WHERE scope = :scope AND key = :k FOR UPDATE;
INSERT INTO bench.orders (scope, key, amount) VALUES (:scope, :k, 100);
UPDATE bench.seed_keys SET status = 'succeeded', response_code = 200, response_body = '{"id": 1, "ok": true}', finished_at = now(), lease_until = NULL, expires_at = now() + interval '1 day', sweep_at = now() + interval '1 day' WHERE scope = :scope AND key = :k;
COMMIT;
