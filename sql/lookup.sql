--
-- lookup.sql: idem_lookup reads a key's state without claiming it: every
-- column, no row when absent or past its retention, own transaction's
-- changes visible.
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);

-- absent: no row, and looking did not create one
SELECT * FROM idempotency.idem_lookup('l1', 'lookup');
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'lookup';

-- pending
INSERT INTO r SELECT 'l1', * FROM idempotency.idem_claim('l1', '{"q": 1}', 'lookup')
RETURNING step, outcome, attempt;
SELECT token AS l1 FROM r WHERE step = 'l1' \gset
SELECT l.status, l.attempt, l.response_code, l.response_body,
       l.created_at = k.created_at AS created_at, l.finished_at,
       l.expires_at = k.expires_at AS expires_at
  FROM idempotency.idem_lookup('l1', 'lookup') l, idempotency.keys k
 WHERE k.scope = 'lookup' AND k.key = 'l1';
-- lookup does not claim: the key is unchanged and still pending
SELECT k::text AS l1_row FROM idempotency.keys k WHERE k.scope = 'lookup' AND k.key = 'l1' \gset
SELECT count(*) AS rows FROM idempotency.idem_lookup('l1', 'lookup');
SELECT k::text = :'l1_row' AS unchanged FROM idempotency.keys k
 WHERE k.scope = 'lookup' AND k.key = 'l1';

-- succeeded: every column matches the stored row
SELECT idempotency.idem_finish('l1', :l1, 201, '{"id": 1}', 'lookup') AS e1 \gset
SELECT l.status, l.attempt, l.response_code, l.response_body,
       l.created_at = k.created_at AS created_at,
       l.finished_at = k.finished_at AS finished_at,
       l.expires_at = :'e1' AS expires_at_returned_by_finish,
       l.finished_at >= l.created_at AS finished_after_created
  FROM idempotency.idem_lookup('l1', 'lookup') l, idempotency.keys k
 WHERE k.scope = 'lookup' AND k.key = 'l1';

-- failed, and a later attempt number
INSERT INTO r SELECT 'l2', * FROM idempotency.idem_claim('l2', scope => 'lookup', lease => '1 second')
RETURNING step, outcome, attempt;
SELECT pg_sleep(1.1);
INSERT INTO r SELECT 'l2b', * FROM idempotency.idem_claim('l2', scope => 'lookup')
RETURNING step, outcome, attempt;
SELECT idempotency.idem_finish('l2', token, 422, '{"error": "invalid"}', 'lookup', 'failed') IS NOT NULL AS finished
  FROM r WHERE step = 'l2b';
SELECT status, attempt, response_code, response_body, finished_at IS NOT NULL AS finished
  FROM idempotency.idem_lookup('l2', 'lookup');

-- scopes are separate; the default scope is ''
SELECT count(*) AS rows FROM idempotency.idem_lookup('l1', 'lookup-other');
SELECT count(*) AS rows FROM idempotency.idem_lookup('l1');
INSERT INTO r SELECT 'l3', * FROM idempotency.idem_claim('lookup:default')
RETURNING step, outcome, attempt;
SELECT status, attempt FROM idempotency.idem_lookup('lookup:default');
SELECT status, attempt FROM idempotency.idem_lookup('lookup:default', '');

-- own transaction's changes are visible; a rollback takes them away
BEGIN;
INSERT INTO r SELECT 'l4', * FROM idempotency.idem_claim('l4', scope => 'lookup')
RETURNING step, outcome, attempt;
SELECT status, attempt FROM idempotency.idem_lookup('l4', 'lookup');
SELECT idempotency.idem_finish('l4', token, 200, '{"tx": true}', 'lookup') IS NOT NULL AS finished
  FROM r WHERE step = 'l4';
SELECT status, response_body FROM idempotency.idem_lookup('l4', 'lookup');
ROLLBACK;
SELECT count(*) AS rows FROM idempotency.idem_lookup('l4', 'lookup');

-- past its retention a key is absent for lookup, even before any sweep
-- removed it (the row lock keeps the background sweeper away meanwhile)
INSERT INTO r SELECT 'l5', * FROM idempotency.idem_claim('l5', scope => 'lookup')
RETURNING step, outcome, attempt;
SELECT idempotency.idem_finish('l5', token, 200, NULL, 'lookup', retention => '1 second') IS NOT NULL AS finished
  FROM r WHERE step = 'l5';
SELECT count(*) AS rows FROM idempotency.idem_lookup('l5', 'lookup');
BEGIN;
SELECT count(*) AS locked
  FROM (SELECT 1 FROM idempotency.keys WHERE scope = 'lookup' AND key = 'l5' FOR UPDATE) l;
SELECT pg_sleep(1.1);
SELECT count(*) AS lookup_rows FROM idempotency.idem_lookup('l5', 'lookup');
SELECT count(*) AS table_rows, bool_and(expires_at <= clock_timestamp()) AS past_retention
  FROM idempotency.keys WHERE scope = 'lookup' AND key = 'l5';
COMMIT;
-- a pending key never finished is gone retention after its claim
INSERT INTO r SELECT 'l6', * FROM idempotency.idem_claim('l6', scope => 'lookup',
       lease => '1 second', retention => '1 second')
RETURNING step, outcome, attempt;
SELECT status, attempt FROM idempotency.idem_lookup('l6', 'lookup');
SELECT pg_sleep(1.1);
SELECT count(*) AS rows FROM idempotency.idem_lookup('l6', 'lookup');

-- lookup returns the stored result exactly, including jsonb null vs SQL NULL
INSERT INTO r SELECT 'l7', * FROM idempotency.idem_claim('l7', scope => 'lookup')
RETURNING step, outcome, attempt;
SELECT idempotency.idem_finish('l7', token, NULL, 'null', 'lookup') IS NOT NULL AS finished
  FROM r WHERE step = 'l7';
SELECT response_code IS NULL AS code_null, response_body IS NULL AS body_sql_null,
       response_body = 'null'::jsonb AS body_json_null
  FROM idempotency.idem_lookup('l7', 'lookup');

DELETE FROM idempotency.keys WHERE scope = 'lookup' OR (scope = '' AND key = 'lookup:default');
