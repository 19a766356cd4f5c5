-- row 17: row 1 with a session-bound claim: idem_claim(..., session_bound
-- => true) then idem_finish, autocommit (2 commits)
\set k random(1, 1000000000000000000)
SELECT token FROM idempotency.idem_claim(:k, '{"amount": 100}', :scope, session_bound => true) \gset
SELECT idempotency.idem_finish(:k, :token, 200, '{"id": 1, "ok": true}', :scope);
