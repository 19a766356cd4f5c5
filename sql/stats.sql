--
-- stats.sql: the idempotency.stats view (the test cluster preloads the
-- library, so the counters exist): stats_reset() zeroes them, each answer
-- and call is counted once (rolled-back calls included), sweeps count what
-- they did, and the key counts come from the table.
--
\set VERBOSITY sqlstate

-- in a database that has not counted anything yet, the counters read 0
-- (NULL would mean "library not preloaded")
SELECT current_database() AS regress_db \gset
CREATE DATABASE regress_idem_stats_fresh TEMPLATE template0;
\c regress_idem_stats_fresh
CREATE EXTENSION idempotency;
SELECT database = current_database() AS this_db, claims, takeovers, replays, in_progress,
       mismatches, finishes, releases, expired, reset, pending, succeeded, failed
  FROM idempotency.stats WHERE database = current_database();
\c :regress_db
DROP DATABASE regress_idem_stats_fresh WITH (FORCE);
\set VERBOSITY sqlstate
-- (temporary objects after the \c above: a reconnect drops them)
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);
CREATE TEMP VIEW counters AS
SELECT claims, takeovers, replays, in_progress, mismatches, finishes, releases
  FROM idempotency.stats WHERE database = current_database();

-- this database's row is always there
SELECT count(*) AS rows FROM idempotency.stats WHERE database = current_database();
SELECT clock_timestamp() AS before_reset \gset
SELECT idempotency.stats_reset() AS reset;
SELECT * FROM counters;
-- last_sweep_at was cleared (the worker may sweep this database again at once)
SELECT last_sweep_at IS NULL OR last_sweep_at >= :'before_reset' AS cleared
  FROM idempotency.stats WHERE database = current_database();

-- claimed, in_progress, mismatch, finish, replay x2
INSERT INTO r SELECT 'a', * FROM idempotency.idem_claim('a', '{"v": 1}', 'stats') RETURNING step, outcome;
INSERT INTO r SELECT 'a2', * FROM idempotency.idem_claim('a', '{"v": 1}', 'stats') RETURNING step, outcome;
INSERT INTO r SELECT 'a3', * FROM idempotency.idem_claim('a', '{"v": 2}', 'stats') RETURNING step, outcome;
SELECT idempotency.idem_finish('a', token, 200, NULL, 'stats') IS NOT NULL AS finished FROM r WHERE step = 'a';
INSERT INTO r SELECT 'a4', * FROM idempotency.idem_claim('a', '{"v": 1}', 'stats') RETURNING step, outcome;
INSERT INTO r SELECT 'a5', * FROM idempotency.idem_claim('a', '{"v": 1}', 'stats') RETURNING step, outcome;
-- claimed, release
INSERT INTO r SELECT 'b', * FROM idempotency.idem_claim('b', scope => 'stats') RETURNING step, outcome;
SELECT idempotency.idem_release('b', token, 'stats') AS released FROM r WHERE step = 'b';
-- claimed, then a takeover
INSERT INTO r SELECT 'c', * FROM idempotency.idem_claim('c', scope => 'stats', lease => '1 second')
RETURNING step, outcome;
SELECT pg_sleep(1.1);
INSERT INTO r SELECT 'c2', * FROM idempotency.idem_claim('c', scope => 'stats') RETURNING step, outcome, attempt;
-- a claim rolled back still counts
BEGIN;
SELECT outcome FROM idempotency.idem_claim('d', scope => 'stats');
ROLLBACK;
-- errors count nothing
SELECT idempotency.idem_finish('absent', 1, 200, NULL, 'stats');
SELECT * FROM idempotency.idem_claim('', scope => 'stats');
SELECT * FROM counters;

-- key counts by status, from the table (this database)
INSERT INTO r SELECT 'e', * FROM idempotency.idem_claim('e', scope => 'stats') RETURNING step, outcome;
SELECT idempotency.idem_finish('e', token, 500, NULL, 'stats', 'failed') IS NOT NULL AS finished FROM r WHERE step = 'e';
SELECT pending, succeeded, failed FROM idempotency.stats WHERE database = current_database();
SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE status = 'failed') AS failed
  FROM idempotency.keys WHERE expires_at > clock_timestamp();

-- a sweep counts what it expired and reset, and records itself
INSERT INTO r SELECT 'f', * FROM idempotency.idem_claim('f', scope => 'stats') RETURNING step, outcome;
SELECT idempotency.idem_finish('f', token, 200, NULL, 'stats', retention => '1 second') IS NOT NULL AS finished
  FROM r WHERE step = 'f';
INSERT INTO r SELECT 'g', * FROM idempotency.idem_claim('g', scope => 'stats', lease => '1 second')
RETURNING step, outcome;
SELECT expired AS expired0, reset AS reset0 FROM idempotency.stats WHERE database = current_database() \gset
BEGIN;
SELECT count(*) AS locked
  FROM (SELECT 1 FROM idempotency.keys WHERE scope = 'stats' AND key IN ('f', 'g') FOR UPDATE) l;
SELECT pg_sleep(1.1);
SELECT clock_timestamp() AS before_sweep \gset
SELECT * FROM idempotency.idem_sweep();
COMMIT;
SELECT expired - :expired0 >= 1 AND reset - :reset0 >= 1 AS counted,
       last_sweep_at >= :'before_sweep' AS last_sweep_recorded,
       last_sweep_ms >= 0 AS duration
  FROM idempotency.stats WHERE database = current_database();

-- stats_reset zeroes everything again
SELECT clock_timestamp() AS before_reset \gset
SELECT idempotency.stats_reset() AS reset;
SELECT *, (SELECT expired = 0 AND reset = 0 AND
                  (last_sweep_at IS NULL OR last_sweep_at >= :'before_reset')
             FROM idempotency.stats WHERE database = current_database()) AS sweep_counters_zero
  FROM counters;

DELETE FROM idempotency.keys WHERE scope = 'stats';
