-- row 26: row 1 with the request kept for a completer (keep_request)
\set k random(1, 1000000000000000000)
SELECT token FROM idempotency.idem_claim(:k, '{"amount": 100}', :scope, keep_request => true) \gset
SELECT idempotency.idem_finish(:k, :token, 200, '{"id": 1, "ok": true}', :scope);
