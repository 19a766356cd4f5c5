-- row 2: extension, one transaction: claim, one business INSERT, finish, COMMIT
\set k random(1, 1000000000000000000)
BEGIN;
SELECT token FROM idempotency.idem_claim(:k, '{"amount": 100}', :scope) \gset
INSERT INTO bench.orders (scope, key, amount) VALUES (:scope, :k, 100);
SELECT idempotency.idem_finish(:k, :token, 200, '{"id": 1, "ok": true}', :scope);
COMMIT;
