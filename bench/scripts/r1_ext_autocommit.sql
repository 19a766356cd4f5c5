-- row 1: extension, autocommit: idem_claim then idem_finish (2 commits)
\set k random(1, 1000000000000000000)
SELECT token FROM idempotency.idem_claim(:k, '{"amount": 100}', :scope) \gset
SELECT idempotency.idem_finish(:k, :token, 200, '{"id": 1, "ok": true}', :scope);
