-- A sweep must get past a backlog of rows it only has to reschedule
-- (finished keys whose sweep_at is still their claim's lease end) to the
-- keys whose retention has passed behind them, in one idem_sweep call.
-- This session locks the rows (FOR UPDATE) right after making them, a
-- second before they are due, and sweeps in that same transaction: the
-- background worker skips rows others have locked, so it cannot take part.
SET search_path = idempotency;
SELECT count(idem_finish(k, c.token, 200, scope => 'backlog'))
  FROM generate_series(1, 5000) g, LATERAL (SELECT 'k' || g AS k) x,
       LATERAL idem_claim(x.k, NULL, 'backlog', '1 s') c;
SELECT token AS old_token FROM idem_claim('old', NULL, 'backlog', '2 s', '2 s') \gset
SELECT idem_finish('old', :old_token, 200, NULL, 'backlog', 'succeeded', '2 s') IS NOT NULL AS finished;
BEGIN;
SELECT count(*) AS locked FROM (SELECT 1 FROM keys WHERE scope = 'backlog' FOR UPDATE) l;
SELECT pg_sleep(2.5);
-- one call: the 5000 reschedules do not count, the expired key does (only
-- this session can sweep these rows, so exactly one key is expired)
SELECT expired, reset FROM idem_sweep(1000);
SELECT count(*) FILTER (WHERE expires_at <= clock_timestamp()) AS past_retention_left,
       count(*) FILTER (WHERE sweep_at <= clock_timestamp()) AS due_left,
       count(*) AS kept
  FROM keys WHERE scope = 'backlog';
COMMIT;
-- every kept key still replays
SELECT count(*) FILTER (WHERE c.outcome = 'replay') AS replays
  FROM generate_series(1, 5000) g, LATERAL idem_claim('k' || g, NULL, 'backlog') c;
DELETE FROM keys WHERE scope = 'backlog';
