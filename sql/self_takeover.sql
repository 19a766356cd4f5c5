--
-- self_takeover.sql: a claim that the caller's own open transaction holds
-- (an earlier element of the same batch, or an earlier idem_claim in the
-- same transaction) answers in_progress, retry_after 1, whatever its lease:
-- the caller never takes over its own running attempt, and the stored row
-- keeps attempt 1 and the first token.  Once that transaction committed,
-- another claim takes the expired lease over as usual.
--
\set VERBOSITY sqlstate

-- a batch repeating a key, with a lease shorter than the batch takes
SELECT ord, key, outcome, attempt, token IS NOT NULL AS has_token, retry_after
  FROM idempotency.idem_claim_many('{a,a,a}', scope => 'self',
                                   lease => '1 microsecond');
SELECT key, status, attempt FROM idempotency.keys WHERE scope = 'self';
-- the same with session-bound claims
SELECT ord, key, outcome, attempt, retry_after
  FROM idempotency.idem_claim_many('{s,s}', scope => 'self',
                                   lease => '1 microsecond', session_bound => true);

-- in one transaction: claim, let the lease end, claim again
CREATE TEMP TABLE first_claim AS SELECT 0::bigint AS token;
BEGIN;
UPDATE first_claim SET token = c.token
  FROM idempotency.idem_claim('b', scope => 'self', lease => '1 millisecond') c
 WHERE c.outcome = 'claimed' AND c.attempt = 1;
SELECT count(*) AS waited FROM idempotency.keys k, pg_sleep_until(k.lease_until)
 WHERE k.scope = 'self' AND k.key = 'b';
SELECT outcome, token, attempt, retry_after
  FROM idempotency.idem_claim('b', scope => 'self');
-- with a wait it answers at once too (it never waits for itself)
SELECT outcome, retry_after
  FROM idempotency.idem_claim('b', scope => 'self', wait => '1 second');
-- a batch in the same transaction likewise
SELECT ord, outcome, retry_after
  FROM idempotency.idem_claim_many('{b}', scope => 'self');
SELECT k.attempt, k.token = f.token AS first_token
  FROM idempotency.keys k, first_claim f WHERE k.scope = 'self' AND k.key = 'b';
-- the first token still finishes it
SELECT idempotency.idem_finish('b', f.token, 201, '{"b": 1}', 'self') IS NOT NULL AS finished
  FROM first_claim f;
COMMIT;
SELECT outcome, status, response_code, response_body
  FROM idempotency.idem_claim('b', scope => 'self');

-- after the holder's transaction committed, the expired lease is taken over
SELECT outcome, attempt FROM idempotency.idem_claim('a', scope => 'self');
DELETE FROM idempotency.keys WHERE scope = 'self';
