--
-- transactions.sql: both modes of use.  Autocommit (claim commits at once,
-- finish later, even on another connection) and one transaction (claim,
-- business writes, finish, COMMIT or ROLLBACK; savepoints).
--
\set VERBOSITY sqlstate
CREATE TABLE txn_orders (id int PRIMARY KEY, note text);
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);

--
-- Autocommit: the claim is committed at once; finish comes later, from
-- another session (no session state spans claim and finish).
--
INSERT INTO r SELECT 'a1', * FROM idempotency.idem_claim('auto', '{"order": 1}', 'txn')
RETURNING step, outcome, attempt;
SELECT token AS a1 FROM r WHERE step = 'a1' \gset
SELECT status, attempt FROM idempotency.keys WHERE scope = 'txn' AND key = 'auto';
\c -
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);
INSERT INTO r SELECT 'a1-other-session', * FROM idempotency.idem_claim('auto', '{"order": 1}', 'txn')
RETURNING step, outcome, token, retry_after BETWEEN 1 AND 30 AS retry_after_in_lease;
INSERT INTO txn_orders VALUES (1, 'side effect of auto');
SELECT idempotency.idem_finish('auto', :a1, 201, '{"order": 1}', 'txn') IS NOT NULL AS finished;
INSERT INTO r SELECT 'a1-replay', * FROM idempotency.idem_claim('auto', '{"order": 1}', 'txn')
RETURNING step, outcome, status, response_code, response_body;

-- A finish rolled back leaves the claim pending with the same token, which
-- can finish again.
INSERT INTO r SELECT 'a2', * FROM idempotency.idem_claim('auto2', scope => 'txn')
RETURNING step, outcome, attempt;
SELECT token AS a2 FROM r WHERE step = 'a2' \gset
BEGIN;
SELECT idempotency.idem_finish('auto2', :a2, 200, '{"try": 1}', 'txn') IS NOT NULL AS finished;
ROLLBACK;
SELECT status, attempt, token = :a2 AS same_token, response_body
  FROM idempotency.keys WHERE scope = 'txn' AND key = 'auto2';
SELECT idempotency.idem_finish('auto2', :a2, 200, '{"try": 2}', 'txn') IS NOT NULL AS finished;
SELECT status, response_body FROM idempotency.keys WHERE scope = 'txn' AND key = 'auto2';

-- A release rolled back leaves the claim too.
INSERT INTO r SELECT 'a3', * FROM idempotency.idem_claim('auto3', scope => 'txn')
RETURNING step, outcome, attempt;
SELECT token AS a3 FROM r WHERE step = 'a3' \gset
BEGIN;
SELECT idempotency.idem_release('auto3', :a3, 'txn') AS released;
SELECT count(*) AS rows_in_tx FROM idempotency.keys WHERE scope = 'txn' AND key = 'auto3';
ROLLBACK;
SELECT status, token = :a3 AS same_token FROM idempotency.keys WHERE scope = 'txn' AND key = 'auto3';

--
-- One transaction, committed: the key and the business write together.
--
BEGIN;
INSERT INTO r SELECT 't1', * FROM idempotency.idem_claim('tx-commit', '{"order": 2}', 'txn')
RETURNING step, outcome, attempt;
-- a second claim of a key this transaction holds: in_progress at once
INSERT INTO r SELECT 't1-again', * FROM idempotency.idem_claim('tx-commit', '{"order": 2}', 'txn')
RETURNING step, outcome, token, attempt, status, response_code, response_body,
          retry_after;
INSERT INTO r SELECT 't1-again-wait', * FROM idempotency.idem_claim('tx-commit', '{"order": 2}', 'txn',
       wait => '1 second')
RETURNING step, outcome, token;
-- a different request against it is a mismatch (this transaction's own data)
INSERT INTO r SELECT 't1-other', * FROM idempotency.idem_claim('tx-commit', '{"order": 99}', 'txn')
RETURNING step, outcome, token, attempt, retry_after;
INSERT INTO txn_orders VALUES (2, 'side effect of tx-commit');
SELECT idempotency.idem_finish('tx-commit', token, 201, '{"order": 2}', 'txn') IS NOT NULL AS finished
  FROM r WHERE step = 't1';
-- once finished, this transaction reads its own result back
INSERT INTO r SELECT 't1-own-replay', * FROM idempotency.idem_claim('tx-commit', '{"order": 2}', 'txn')
RETURNING step, outcome, status, response_code, response_body;
COMMIT;
SELECT k.status, k.attempt, k.response_body, o.note
  FROM idempotency.keys k, txn_orders o
 WHERE k.scope = 'txn' AND k.key = 'tx-commit' AND o.id = 2;
INSERT INTO r SELECT 't1-replay', * FROM idempotency.idem_claim('tx-commit', '{"order": 2}', 'txn')
RETURNING step, outcome, status, response_code, response_body;

--
-- One transaction, rolled back: no trace of the claim or the write; the next
-- claim is a fresh attempt 1 with a larger token (tokens are not reused).
--
BEGIN;
INSERT INTO r SELECT 't2', * FROM idempotency.idem_claim('tx-rollback', '{"order": 3}', 'txn')
RETURNING step, outcome, attempt;
INSERT INTO txn_orders VALUES (3, 'side effect of tx-rollback');
SELECT idempotency.idem_finish('tx-rollback', token, 201, '{"order": 3}', 'txn') IS NOT NULL AS finished
  FROM r WHERE step = 't2';
SELECT status FROM idempotency.idem_lookup('tx-rollback', 'txn');
SELECT token AS t2 FROM r WHERE step = 't2' \gset
ROLLBACK;
SELECT count(*) AS keys FROM idempotency.keys WHERE scope = 'txn' AND key = 'tx-rollback';
SELECT count(*) AS orders FROM txn_orders WHERE id = 3;
SELECT count(*) AS lookup_rows FROM idempotency.idem_lookup('tx-rollback', 'txn');
INSERT INTO r SELECT 't2-retry', * FROM idempotency.idem_claim('tx-rollback', '{"order": "changed"}', 'txn')
RETURNING step, outcome, attempt, token > :t2 AS larger_token;
-- and the rolled-back token is of no use
SELECT idempotency.idem_finish('tx-rollback', :t2, 200, NULL, 'txn');

-- An error after the claim aborts the transaction: no key left.
BEGIN;
SELECT outcome, attempt FROM idempotency.idem_claim('tx-error', scope => 'txn');
SELECT 1 / 0;
ROLLBACK;
SELECT count(*) AS keys FROM idempotency.keys WHERE scope = 'txn' AND key = 'tx-error';

--
-- Savepoints: ROLLBACK TO SAVEPOINT past the claim leaves no key; the
-- transaction can claim it again and commit.
--
BEGIN;
SAVEPOINT before_claim;
SELECT outcome, attempt FROM idempotency.idem_claim('tx-savepoint', '{"order": 4}', 'txn');
SELECT count(*) AS keys_in_tx FROM idempotency.keys WHERE scope = 'txn' AND key = 'tx-savepoint';
ROLLBACK TO SAVEPOINT before_claim;
SELECT count(*) AS keys_in_tx FROM idempotency.keys WHERE scope = 'txn' AND key = 'tx-savepoint';
SELECT count(*) AS lookup_rows FROM idempotency.idem_lookup('tx-savepoint', 'txn');
INSERT INTO r SELECT 't3', * FROM idempotency.idem_claim('tx-savepoint', '{"order": "other"}', 'txn')
RETURNING step, outcome, attempt;
-- a savepoint rolled back past the finish leaves the claim pending
SAVEPOINT before_finish;
SELECT idempotency.idem_finish('tx-savepoint', token, 500, NULL, 'txn', 'failed') IS NOT NULL AS finished
  FROM r WHERE step = 't3';
ROLLBACK TO SAVEPOINT before_finish;
SELECT status, attempt FROM idempotency.idem_lookup('tx-savepoint', 'txn');
SELECT idempotency.idem_finish('tx-savepoint', token, 201, '{"order": 4}', 'txn') IS NOT NULL AS finished
  FROM r WHERE step = 't3';
-- an error in a subtransaction after the claim, rolled back to the savepoint
SAVEPOINT before_error;
SELECT outcome FROM idempotency.idem_claim('tx-savepoint-2', scope => 'txn');
SELECT 1 / 0;
ROLLBACK TO SAVEPOINT before_error;
COMMIT;
SELECT key, status, attempt, response_code, response_body FROM idempotency.keys
 WHERE scope = 'txn' AND key LIKE 'tx-savepoint%' ORDER BY key;

-- A PL/pgSQL exception block (a subtransaction) rolled back past a claim
-- and its finish leaves no key either; the key can be claimed again.
BEGIN;
DO $$
DECLARE
	c record;
BEGIN
	BEGIN
		SELECT * INTO c FROM idempotency.idem_claim('tx-exception', scope => 'txn');
		PERFORM idempotency.idem_finish('tx-exception', c.token, 200, NULL, 'txn');
		RAISE EXCEPTION 'the handler failed';
	EXCEPTION WHEN raise_exception THEN
		NULL;
	END;
END
$$;
SELECT count(*) AS keys_in_tx FROM idempotency.keys WHERE scope = 'txn' AND key = 'tx-exception';
SELECT outcome, attempt FROM idempotency.idem_claim('tx-exception', scope => 'txn');
SELECT outcome, retry_after FROM idempotency.idem_claim('tx-exception', scope => 'txn');
COMMIT;
SELECT status, attempt FROM idempotency.keys WHERE scope = 'txn' AND key = 'tx-exception';

--
-- Leases are measured on the wall clock at the moment of the call, not from
-- the start of the transaction.
--
BEGIN;
SELECT pg_sleep(1.1);
SELECT clock_timestamp() AS b1 \gset
INSERT INTO r SELECT 't4', * FROM idempotency.idem_claim('tx-clock', scope => 'txn', lease => '10 seconds')
RETURNING step, outcome, attempt;
SELECT created_at >= :'b1' AS created_at_call_time,
       created_at > now() + '1 second' AS not_transaction_start,
       lease_until >= :'b1'::timestamptz + '10 seconds' AS lease_from_call_time
  FROM idempotency.keys WHERE scope = 'txn' AND key = 'tx-clock';
COMMIT;

--
-- Under REPEATABLE READ and SERIALIZABLE a lone session works as usual.
--
BEGIN ISOLATION LEVEL REPEATABLE READ;
INSERT INTO r SELECT 't5', * FROM idempotency.idem_claim('tx-rr', scope => 'txn')
RETURNING step, outcome, attempt;
SELECT idempotency.idem_finish('tx-rr', token, 200, '{"iso": "rr"}', 'txn') IS NOT NULL AS finished
  FROM r WHERE step = 't5';
COMMIT;
BEGIN ISOLATION LEVEL SERIALIZABLE;
INSERT INTO r SELECT 't6', * FROM idempotency.idem_claim('tx-rr', scope => 'txn')
RETURNING step, outcome, status, response_body;
INSERT INTO r SELECT 't7', * FROM idempotency.idem_claim('tx-ser', scope => 'txn')
RETURNING step, outcome, attempt;
SELECT idempotency.idem_finish('tx-ser', token, 200, '{"iso": "ser"}', 'txn') IS NOT NULL AS finished
  FROM r WHERE step = 't7';
COMMIT;
SELECT key, status, response_body FROM idempotency.keys
 WHERE scope = 'txn' AND key IN ('tx-rr', 'tx-ser') ORDER BY key;

-- Tokens, in the order this session received them, only grow.
SELECT bool_and(token > prev) AS strictly_increasing
  FROM (SELECT token, lag(token) OVER (ORDER BY n) AS prev
          FROM r WHERE token IS NOT NULL) s
 WHERE prev IS NOT NULL;

DROP TABLE txn_orders;
DELETE FROM idempotency.keys WHERE scope = 'txn';
