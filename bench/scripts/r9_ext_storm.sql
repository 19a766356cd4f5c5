-- row 9: retry storm: many clients on 100 hot keys of a fresh scope; whoever
-- gets 'claimed' finishes, everybody else gets in_progress or replay
\set k random(1, 100)
SELECT coalesce(token, 0) AS token FROM idempotency.idem_claim(:k, '{"amount": 100}', :scope) \gset
\if :token > 0
SELECT idempotency.idem_finish(:k, :token, 200, '{"id": 1, "ok": true}', :scope);
\endif
