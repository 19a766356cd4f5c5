--
-- reinstall.sql: a session that used the functions keeps working after
-- DROP EXTENSION and CREATE EXTENSION (nothing cached per backend points at
-- the old objects), also when the drop and re-create are rolled back.
--
\set VERBOSITY sqlstate

-- warm every function up in this session
SELECT outcome, attempt FROM idempotency.idem_claim('r1', '{"v": 1}', 'reinstall');
SELECT idempotency.idem_extend('r1', k.token, '1 minute', 'reinstall') IS NOT NULL AS extended,
       idempotency.idem_finish('r1', k.token, 200, '{"v": 1}', 'reinstall') IS NOT NULL AS finished
  FROM idempotency.keys k WHERE k.scope = 'reinstall' AND k.key = 'r1';
SELECT outcome, response_body FROM idempotency.idem_claim('r1', '{"v": 1}', 'reinstall');
SELECT outcome FROM idempotency.idem_claim('r1', '{"v": 2}', 'reinstall');
SELECT outcome FROM idempotency.idem_claim('r2', scope => 'reinstall');
SELECT outcome FROM idempotency.idem_claim('r2', scope => 'reinstall');
SELECT idempotency.idem_release('r2', k.token, 'reinstall') AS released
  FROM idempotency.keys k WHERE k.scope = 'reinstall' AND k.key = 'r2';
SELECT status FROM idempotency.idem_lookup('r1', 'reinstall');
SELECT expired >= 0 AS swept FROM idempotency.idem_sweep(10);
SELECT idempotency.idem_finish('absent', 1, 200, NULL, 'reinstall');

-- drop and re-create, then use everything again in the same session
DROP EXTENSION idempotency;
SELECT count(*) AS tables FROM pg_class WHERE relname = 'keys'
   AND relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = 'idempotency');
CREATE EXTENSION idempotency;
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'reinstall';
SELECT outcome, attempt FROM idempotency.idem_claim('r1', '{"v": 2}', 'reinstall');
SELECT outcome FROM idempotency.idem_claim('r1', '{"v": 2}', 'reinstall');
SELECT outcome FROM idempotency.idem_claim('r1', '{"v": 3}', 'reinstall');
SELECT idempotency.idem_extend('r1', k.token, '1 minute', 'reinstall') IS NOT NULL AS extended,
       idempotency.idem_finish('r1', k.token, 201, '{"v": 2}', 'reinstall') IS NOT NULL AS finished
  FROM idempotency.keys k WHERE k.scope = 'reinstall' AND k.key = 'r1';
SELECT outcome, response_code, response_body FROM idempotency.idem_claim('r1', '{"v": 2}', 'reinstall');
SELECT outcome FROM idempotency.idem_claim('r2', scope => 'reinstall');
SELECT idempotency.idem_release('r2', k.token, 'reinstall') AS released
  FROM idempotency.keys k WHERE k.scope = 'reinstall' AND k.key = 'r2';
SELECT status, attempt, response_code FROM idempotency.idem_lookup('r1', 'reinstall');
SELECT * FROM idempotency.idem_sweep(10);
SELECT idempotency.idem_finish('absent', 1, 200, NULL, 'reinstall');

-- drop and re-create inside a transaction that rolls back: the original
-- objects (and their rows) come back and still work
BEGIN;
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency;
SELECT outcome, attempt FROM idempotency.idem_claim('r3', scope => 'reinstall');
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'reinstall';
ROLLBACK;
SELECT key, status FROM idempotency.keys WHERE scope = 'reinstall' ORDER BY key;
SELECT outcome, response_code FROM idempotency.idem_claim('r1', '{"v": 2}', 'reinstall');
SELECT outcome, attempt FROM idempotency.idem_claim('r3', scope => 'reinstall');
SELECT idempotency.idem_finish('r3', k.token, 200, NULL, 'reinstall') IS NOT NULL AS finished
  FROM idempotency.keys k WHERE k.scope = 'reinstall' AND k.key = 'r3';
SELECT key, status FROM idempotency.keys WHERE scope = 'reinstall' ORDER BY key;

DELETE FROM idempotency.keys WHERE scope = 'reinstall';

-- the indexes the C code scans directly must be the ones the extension
-- created: a dropped or look-alike index is refused with 55000 before any
-- scan (rolled back: the original indexes come back and work).  The
-- messages are compared, not where they come from (the SQL edition raises
-- them from PL/pgSQL, which adds a CONTEXT).
\set VERBOSITY default
\set SHOW_CONTEXT never
BEGIN;
DROP INDEX idempotency.keys_sweep_at_idx;
SAVEPOINT s;
SELECT outcome FROM idempotency.idem_claim('r4', scope => 'reinstall');
ROLLBACK TO s;
CREATE INDEX keys_sweep_at_idx ON idempotency.keys (expires_at);
SAVEPOINT s;
SELECT * FROM idempotency.idem_sweep(10);
ROLLBACK TO s;
SELECT outcome FROM idempotency.idem_claim('r4', scope => 'reinstall');
ROLLBACK TO s;
DROP INDEX idempotency.keys_sweep_at_idx;
CREATE INDEX keys_sweep_at_idx ON idempotency.keys (sweep_at) WHERE status = 'pending';
SELECT * FROM idempotency.idem_sweep(10);
ROLLBACK;
BEGIN;
ALTER TABLE idempotency.keys DROP CONSTRAINT keys_pkey;
CREATE UNIQUE INDEX keys_pkey ON idempotency.keys (key, scope);
SELECT outcome FROM idempotency.idem_claim('r4', scope => 'reinstall');
ROLLBACK;
\set VERBOSITY sqlstate
\set SHOW_CONTEXT errors
SELECT outcome, attempt FROM idempotency.idem_claim('r4', scope => 'reinstall');
SELECT * FROM idempotency.idem_sweep(10);
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'reinstall';
DELETE FROM idempotency.keys WHERE scope = 'reinstall';
