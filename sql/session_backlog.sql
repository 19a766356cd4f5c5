--
-- session_backlog.sql: the keys of 5,000 ended sessions (more than one
-- scan chunk of keys_owner_session_idx, which reads 4,096 rows at a time)
-- are all reclaimable at once, and idem_sweep resets every one of them
-- within ceil(5000 / batch_size) + 1 calls.  One session makes the 5,000
-- bindings: pg_advisory_unlock_all() lets its binding go, as a session's
-- end does, and its next session-bound claim takes a new one.
--
-- The sweep counts are exact only while nobody else sweeps this database:
-- run with the background sweeper off (idempotency.sweep_interval = 0).
--
\set VERBOSITY sqlstate

SELECT count(*) AS calls FROM idempotency.idem_sweep(NULL);

DO $$
BEGIN
	FOR i IN 1 .. 5000 LOOP
		PERFORM idempotency.idem_claim('s' || i, scope => 'session-backlog',
		                               lease => '1 hour', session_bound => true);
		PERFORM pg_advisory_unlock_all();
	END LOOP;
END $$;
SELECT count(*) AS keys, count(DISTINCT owner_session) AS sessions
  FROM idempotency.keys WHERE scope = 'session-backlog' AND token IS NOT NULL;

-- every one is reclaimable at once: a claim takes it over
SELECT outcome, attempt FROM idempotency.idem_claim('s1', scope => 'session-backlog');
SELECT outcome, attempt FROM idempotency.idem_claim('s5000', scope => 'session-backlog');

-- the sweep resets the other 4,998 in batches of 1,000
CREATE TEMP TABLE passes (n serial, reset bigint);
DO $$
DECLARE
	r bigint;
BEGIN
	LOOP
		SELECT s.reset INTO r FROM idempotency.idem_sweep(1000) s;
		INSERT INTO passes (reset) VALUES (r);
		EXIT WHEN r = 0 OR (SELECT count(*) FROM passes) > 20;
	END LOOP;
END $$;
SELECT n, reset FROM passes ORDER BY n;
SELECT count(*) FILTER (WHERE token IS NULL) AS reset_keys,
       count(*) FILTER (WHERE token IS NOT NULL) AS held_keys
  FROM idempotency.keys WHERE scope = 'session-backlog';

DELETE FROM idempotency.keys WHERE scope = 'session-backlog';
SELECT pg_advisory_unlock_all();
