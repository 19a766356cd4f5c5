-- row 19, both editions: row 1's claim + finish in autocommit, the finish
-- only after 'claimed' (bench/run's check counts the finished keys): the SQL
-- edition can answer in_progress for a fresh key when its insert waits more
-- than 1 ms for a lock
\set k random(1, 1000000000000000000)
SELECT coalesce(token, 0) AS token FROM idempotency.idem_claim(:k, '{"amount": 100}', :scope) \gset
\if :token > 0
SELECT idempotency.idem_finish(:k, :token, 200, '{"id": 1, "ok": true}', :scope);
\endif
