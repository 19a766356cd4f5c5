--
-- stats_key_counts.sql: where the stats view's key counts come from.  While
-- idempotency.keys is at most idempotency.stats_exact_limit in size they are
-- counted (keys whose retention ended left out) and key_counts_exact is
-- true; above it they are the planner's estimate from the last ANALYZE
-- (NULL before the first one), and key_counts_exact is false.
--
\set VERBOSITY sqlstate
SELECT current_database() AS regress_db \gset
-- a database of its own: the counts are this test's keys only
CREATE DATABASE regress_idem_key_counts TEMPLATE template0;
\c regress_idem_key_counts
\set VERBOSITY sqlstate
CREATE EXTENSION idempotency;
SHOW idempotency.stats_exact_limit;

-- 3 pending, 5 succeeded, 2 failed, and 1 succeeded key whose retention ends
SELECT count(*) AS pending FROM generate_series(1, 3) i,
       idempotency.idem_claim('p' || i, lease => '1 hour') c WHERE c.outcome = 'claimed';
SELECT count(idempotency.idem_finish('s' || i, c.token, 200)) AS succeeded
  FROM generate_series(1, 5) i, idempotency.idem_claim('s' || i) c;
SELECT count(idempotency.idem_finish('f' || i, c.token, 402, status => 'failed')) AS failed
  FROM generate_series(1, 2) i, idempotency.idem_claim('f' || i) c;
SELECT idempotency.idem_finish('gone', c.token, 200, retention => '1 second') IS NOT NULL AS gone
  FROM idempotency.idem_claim('gone') c;
SELECT pg_sleep(1.1);

-- small: exact, the key whose retention ended is not counted
SELECT pending, succeeded, failed, key_counts_exact
  FROM idempotency.stats WHERE database = current_database();
SELECT * FROM idempotency.stats_key_counts();

-- above the limit, never analyzed: no estimate
SET idempotency.stats_exact_limit = 0;
SELECT reltuples < 0 AS never_analyzed FROM pg_class WHERE oid = 'idempotency.keys'::regclass;
SELECT pending, succeeded, failed, key_counts_exact
  FROM idempotency.stats WHERE database = current_database();

-- after ANALYZE (which reads the whole of a small table): the estimate is
-- every stored key, the one whose retention ended included until a sweep
-- deletes it
ANALYZE idempotency.keys;
SELECT pending, succeeded, failed, key_counts_exact
  FROM idempotency.stats WHERE database = current_database();
SELECT * FROM idempotency.idem_sweep();
SELECT pending, succeeded, failed, key_counts_exact
  FROM idempotency.stats WHERE database = current_database();
ANALYZE idempotency.keys;
SELECT pending, succeeded, failed, key_counts_exact
  FROM idempotency.stats WHERE database = current_database();

-- -1 counts exactly whatever the size
SET idempotency.stats_exact_limit = -1;
SELECT pending, succeeded, failed, key_counts_exact
  FROM idempotency.stats WHERE database = current_database();
RESET idempotency.stats_exact_limit;

-- only a superuser sets the limit: a monitoring role cannot make every poll
-- scan a large table
CREATE ROLE regress_idem_monitor;
GRANT USAGE ON SCHEMA idempotency TO regress_idem_monitor;
SET ROLE regress_idem_monitor;
SET idempotency.stats_exact_limit = -1;
SELECT pending, succeeded, failed, key_counts_exact
  FROM idempotency.stats WHERE database = current_database();
RESET ROLE;

-- the counts answer only a role that may read the view: revoking SELECT on
-- the view hides them however the role asks
REVOKE SELECT ON idempotency.stats FROM PUBLIC;
SET ROLE regress_idem_monitor;
SELECT pending FROM idempotency.stats;
SELECT * FROM idempotency.stats_key_counts();
RESET ROLE;
GRANT SELECT ON idempotency.stats TO regress_idem_monitor;
SET ROLE regress_idem_monitor;
SELECT * FROM idempotency.stats_key_counts();
RESET ROLE;
GRANT SELECT ON idempotency.stats TO PUBLIC;
REVOKE SELECT ON idempotency.stats FROM regress_idem_monitor;

-- a table whose NOT NULL constraints someone dropped is refused (55000),
-- as by every function that reads keys, rows with NULLs or not
BEGIN;
ALTER TABLE idempotency.keys ALTER status DROP NOT NULL, ALTER expires_at DROP NOT NULL;
INSERT INTO idempotency.keys VALUES ('x', 'null-status', NULL, 1, 1, NULL, NULL, NULL,
	now(), NULL, NULL, now() + interval '1 hour', interval '1 hour', now() + interval '1 hour');
INSERT INTO idempotency.keys VALUES ('x', 'null-expiry', 'pending', 1, 1, NULL, NULL, NULL,
	now(), NULL, NULL, NULL, interval '1 hour', now() + interval '1 hour');
SELECT * FROM idempotency.stats_key_counts();
ROLLBACK;

-- bad values
SET idempotency.stats_exact_limit = -2;
SET idempotency.stats_exact_limit = 'lots';

\c :regress_db
DROP DATABASE regress_idem_key_counts WITH (FORCE);
DROP ROLE regress_idem_monitor;
