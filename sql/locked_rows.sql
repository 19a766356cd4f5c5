--
-- locked_rows.sql: a key whose row another transaction has locked (FOR
-- UPDATE) never makes a call wait: a claim that would have to write
-- answers in_progress (retry_after 1), finish/extend/release raise 55P03,
-- and idem_sweep skips the row.  Reads (replay, in_progress, mismatch,
-- lookup) are unaffected.
--
-- The second transaction runs over dblink (skipped where dblink is not
-- available: locked_rows_1.out).  statement_timeout turns a call that
-- waits into 57014 instead of a hang.
--
SELECT count(*) = 0 AS skip_test FROM pg_available_extensions WHERE name = 'dblink' \gset
\if :skip_test
\quit
\endif
\set VERBOSITY sqlstate
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS dblink;
RESET client_min_messages;
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);

-- live: pending, live lease          stale: pending, lease ends in 1 s
-- gone: finished, kept 1 s            done: finished, kept 1 day
-- free: finished, kept 1 s, NOT locked (the sweep must still get it)
INSERT INTO r SELECT 'live', * FROM idempotency.idem_claim('live', '{"v": 1}', 'locked')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'stale', * FROM idempotency.idem_claim('stale', '{"v": 2}', 'locked', lease => '1 second')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'gone', * FROM idempotency.idem_claim('gone', '{"v": 3}', 'locked')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'done', * FROM idempotency.idem_claim('done', '{"v": 4}', 'locked')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'free', * FROM idempotency.idem_claim('free', '{"v": 5}', 'locked')
RETURNING step, outcome, attempt;
SELECT count(*) FILTER (WHERE idempotency.idem_finish(step, token, 200, NULL, 'locked',
           retention => CASE step WHEN 'done' THEN interval '1 day' ELSE interval '1 second' END)
           IS NOT NULL) AS finished
  FROM r WHERE step IN ('gone', 'done', 'free');
SELECT token AS live FROM r WHERE step = 'live' \gset
SELECT token AS stale FROM r WHERE step = 'stale' \gset

-- the other transaction locks every row of the scope but "free"
SELECT dblink_connect('locker',
       format('host=%s port=%s dbname=%s user=%s',
              coalesce(nullif(split_part(current_setting('unix_socket_directories'), ',', 1), ''),
                       'localhost'),
              current_setting('port'), current_database(), current_user)) AS connected;
SELECT dblink_exec('locker', 'BEGIN') AS began;
SELECT * FROM dblink('locker', $$
    SELECT count(*) FROM (SELECT 1 FROM idempotency.keys
                           WHERE scope = 'locked' AND key <> 'free' FOR UPDATE) l$$) AS t(locked bigint);
-- this session locks "free" itself (the background sweeper skips rows
-- others have locked), so its retention can pass without a sweep
BEGIN;
SELECT count(*) AS locked_here
  FROM (SELECT 1 FROM idempotency.keys WHERE scope = 'locked' AND key = 'free' FOR UPDATE) l;
SELECT pg_sleep(1.1);
SELECT key, status, lease_until < clock_timestamp() AS lease_ended,
       expires_at <= clock_timestamp() AS past_retention
  FROM idempotency.keys WHERE scope = 'locked' ORDER BY key;

SET LOCAL statement_timeout = '3s';
-- reads: as usual
SELECT outcome, retry_after BETWEEN 1 AND 30 AS retry_after_ok
  FROM idempotency.idem_claim('live', '{"v": 1}', 'locked');
SELECT outcome, status, response_code FROM idempotency.idem_claim('done', '{"v": 4}', 'locked');
SELECT outcome FROM idempotency.idem_claim('done', '{"v": "other"}', 'locked');
SELECT status, attempt FROM idempotency.idem_lookup('done', 'locked');
-- a claim that would have to write: in_progress at once, retry_after 1
SAVEPOINT s;
SELECT outcome, token, retry_after FROM idempotency.idem_claim('stale', '{"v": 2}', 'locked');
ROLLBACK TO SAVEPOINT s;
SELECT outcome, token, retry_after FROM idempotency.idem_claim('gone', '{"v": "new"}', 'locked');
ROLLBACK TO SAVEPOINT s;
-- finish, extend, release: 55P03 at once
SELECT idempotency.idem_finish('live', :live, 200, NULL, 'locked');
ROLLBACK TO SAVEPOINT s;
SELECT idempotency.idem_extend('live', :live, '1 minute', 'locked');
ROLLBACK TO SAVEPOINT s;
SELECT idempotency.idem_release('live', :live, 'locked');
ROLLBACK TO SAVEPOINT s;
SELECT idempotency.idem_finish('stale', :stale, 200, NULL, 'locked');
ROLLBACK TO SAVEPOINT s;
-- the sweep skips the rows the other transaction locked and deletes "free"
SELECT * FROM idempotency.idem_sweep();
SELECT key, status, attempt, token IS NOT NULL AS has_token
  FROM idempotency.keys WHERE scope = 'locked' ORDER BY key;
COMMIT;

-- once the lock is gone, everything proceeds
SELECT dblink_exec('locker', 'COMMIT') AS committed;
SELECT dblink_disconnect('locker') AS disconnected;
SELECT idempotency.idem_finish('live', :live, 201, '{"ok": true}', 'locked') IS NOT NULL AS finished;
SELECT outcome, attempt FROM idempotency.idem_claim('stale', '{"v": 2}', 'locked');
SELECT outcome, attempt FROM idempotency.idem_claim('gone', '{"v": "new"}', 'locked');

DELETE FROM idempotency.keys WHERE scope = 'locked';
