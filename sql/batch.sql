--
-- batch.sql: a consumer batch of 10,000 claims and finishes in one
-- transaction works with default settings: nothing per key is held until
-- commit in the shared lock table.
--
\set VERBOSITY sqlstate
SHOW max_locks_per_transaction;

-- A DO block: claim and finish 10,000 keys in one transaction.
BEGIN;
DO $$
DECLARE
	c record;
	prev bigint := 0;
BEGIN
	FOR i IN 1..10000 LOOP
		SELECT * INTO c FROM idempotency.idem_claim('m' || i, jsonb_build_object('msg', i), 'batch');
		IF c.outcome <> 'claimed' OR c.attempt <> 1 OR c.token <= prev THEN
			RAISE EXCEPTION 'claim % answered % attempt % token order %',
				i, c.outcome, c.attempt, c.token > prev;
		END IF;
		prev := c.token;
		PERFORM idempotency.idem_finish('m' || i, c.token, 200,
										jsonb_build_object('done', i), 'batch');
	END LOOP;
END
$$;
-- no advisory lock (nor any per-key lock) is left behind by 10,000 claims
SELECT count(*) AS advisory_locks FROM pg_locks
 WHERE pid = pg_backend_pid() AND locktype = 'advisory';
SELECT count(*) < 100 AS few_locks FROM pg_locks WHERE pid = pg_backend_pid();
COMMIT;
SELECT count(*) AS rows,
       count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE attempt = 1) AS first_attempts,
       count(DISTINCT token) AS distinct_tokens,
       count(*) FILTER (WHERE response_code = 200
                          AND response_body = jsonb_build_object('done', substr(key, 2)::int)) AS right_body,
       count(*) FILTER (WHERE fingerprint = sha256(convert_to(
                          jsonb_build_object('msg', substr(key, 2)::int)::text, 'UTF8'))) AS right_fingerprint
  FROM idempotency.keys WHERE scope = 'batch';
-- a redelivery of the whole batch replays each message's result
SELECT outcome, count(*) AS messages,
       count(*) FILTER (WHERE response_body = jsonb_build_object('done', g)) AS right_body
  FROM generate_series(1, 10000) g,
       LATERAL idempotency.idem_claim('m' || g, jsonb_build_object('msg', g), 'batch') c
 GROUP BY outcome;

-- A single statement: 10,000 claims, then 10,000 finishes, one transaction.
BEGIN;
CREATE TEMP TABLE claims AS
SELECT g, c.* FROM generate_series(1, 10000) g,
       LATERAL idempotency.idem_claim('s' || g, scope => 'batch-select') c;
SELECT outcome, attempt, count(*) AS claims, count(DISTINCT token) AS tokens
  FROM claims GROUP BY outcome, attempt;
SELECT count(*) FILTER (WHERE idempotency.idem_finish('s' || g, token, 201, NULL,
                                                       'batch-select', 'failed') IS NOT NULL) AS finished
  FROM claims;
SELECT count(*) AS advisory_locks FROM pg_locks
 WHERE pid = pg_backend_pid() AND locktype = 'advisory';
COMMIT;
SELECT status, response_code, count(*) AS rows
  FROM idempotency.keys WHERE scope = 'batch-select' GROUP BY status, response_code;

-- Rolling the batch back leaves nothing.
BEGIN;
SELECT count(*) FILTER (WHERE c.outcome = 'claimed') AS claimed
  FROM generate_series(1, 10000) g,
       LATERAL idempotency.idem_claim('s' || g, scope => 'batch-rollback') c;
ROLLBACK;
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'batch-rollback';

DELETE FROM idempotency.keys WHERE scope IN ('batch', 'batch-select');
