--
-- finish.sql: idem_finish stores the result, returns the expiry, is
-- idempotent for its own token, and refuses every other token.
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);

INSERT INTO r SELECT 'f1', * FROM idempotency.idem_claim('f1', '{"op": "charge"}', 'finish')
RETURNING step, outcome, attempt;
SELECT token AS f1 FROM r WHERE step = 'f1' \gset

-- finish returns the expiry it stored: finished now, kept for the claim's
-- retention (the GUC default, 1 day) after that.
SELECT clock_timestamp() AS b1 \gset
SELECT idempotency.idem_finish('f1', :f1, 201, '{"charge": "ch_1"}', 'finish') AS e1 \gset
SELECT clock_timestamp() AS a1 \gset
SELECT k.status, k.token = :f1 AS same_token, k.attempt, k.response_code, k.response_body,
       k.expires_at = :'e1' AS returned_expiry_stored,
       k.finished_at BETWEEN :'b1' AND :'a1' AS finished_now,
       k.expires_at BETWEEN :'b1'::timestamptz + '1 day'
                        AND :'a1'::timestamptz + '1 day' AS kept_1d,
       k.expires_at >= k.finished_at + '1 day' AS at_least_retention
  FROM idempotency.keys k WHERE k.scope = 'finish' AND k.key = 'f1';
SELECT k::text AS f1_row FROM idempotency.keys k WHERE k.scope = 'finish' AND k.key = 'f1' \gset

-- A repeated finish with the same token changes nothing and returns the same
-- expiry, whatever it carries (a retry after a lost reply).
SELECT idempotency.idem_finish('f1', :f1, 201, '{"charge": "ch_1"}', 'finish') = :'e1' AS same_expiry;
SELECT idempotency.idem_finish('f1', :f1, 500, '{"charge": "other"}', 'finish',
                               'failed', '1 minute') = :'e1' AS same_expiry;
SELECT idempotency.idem_finish('f1', :f1, scope => 'finish') = :'e1' AS same_expiry;
SELECT k::text = :'f1_row' AS unchanged FROM idempotency.keys k
 WHERE k.scope = 'finish' AND k.key = 'f1';

-- Another token on a finished key: 55000, nothing changes.
SELECT idempotency.idem_finish('f1', :f1 + 1, 200, '{"x": 1}', 'finish');
SELECT idempotency.idem_finish('f1', :f1 - 1, 200, '{"x": 1}', 'finish');
SELECT k::text = :'f1_row' AS unchanged FROM idempotency.keys k
 WHERE k.scope = 'finish' AND k.key = 'f1';
-- An absent key: P0002 (also the right key in another scope).
SELECT idempotency.idem_finish('f-absent', :f1, 200, NULL, 'finish');
SELECT idempotency.idem_finish('f1', :f1, 200, NULL, 'finish-other');
SELECT idempotency.idem_finish('f1', :f1, 200, NULL);
SELECT count(*) AS rows FROM idempotency.keys WHERE scope IN ('finish-other', '') AND key IN ('f1', 'f-absent');

-- The stored result is replayed.
INSERT INTO r SELECT 'f1-replay', * FROM idempotency.idem_claim('f1', '{"op": "charge"}', 'finish')
RETURNING step, outcome, token, attempt, status, response_code, response_body, retry_after;

--
-- finish's retention: shorter than the claim's, the claim's by default,
-- longer than the claim's.
--
INSERT INTO r SELECT 'f2', * FROM idempotency.idem_claim('f2', scope => 'finish', retention => '7 days')
RETURNING step, outcome, attempt;
SELECT token AS f2 FROM r WHERE step = 'f2' \gset
SELECT clock_timestamp() AS b2 \gset
SELECT idempotency.idem_finish('f2', :f2, 500, '{"error": "declined"}', 'finish', 'failed', '1 hour') AS e2 \gset
SELECT clock_timestamp() AS a2 \gset
SELECT k.status, k.response_code, k.expires_at = :'e2' AS stored,
       k.expires_at BETWEEN :'b2'::timestamptz + '1 hour'
                        AND :'a2'::timestamptz + '1 hour' AS kept_1h
  FROM idempotency.keys k WHERE k.scope = 'finish' AND k.key = 'f2';

INSERT INTO r SELECT 'f3', * FROM idempotency.idem_claim('f3', scope => 'finish', retention => '2 hours')
RETURNING step, outcome, attempt;
SELECT token AS f3 FROM r WHERE step = 'f3' \gset
SELECT clock_timestamp() AS b3 \gset
SELECT idempotency.idem_finish('f3', :f3, 200, '[1, 2, 3]', 'finish') AS e3 \gset
SELECT clock_timestamp() AS a3 \gset
SELECT k.status, k.response_body, k.expires_at = :'e3' AS stored,
       k.expires_at BETWEEN :'b3'::timestamptz + '2 hours'
                        AND :'a3'::timestamptz + '2 hours' AS kept_claims_2h
  FROM idempotency.keys k WHERE k.scope = 'finish' AND k.key = 'f3';

INSERT INTO r SELECT 'f4', * FROM idempotency.idem_claim('f4', scope => 'finish', retention => '1 hour')
RETURNING step, outcome, attempt;
SELECT token AS f4 FROM r WHERE step = 'f4' \gset
SELECT clock_timestamp() AS b4 \gset
SELECT idempotency.idem_finish('f4', :f4, 200, '"ok"', 'finish', retention => '30 days') AS e4 \gset
SELECT clock_timestamp() AS a4 \gset
SELECT k.status, k.response_body, k.expires_at = :'e4' AS stored,
       k.expires_at BETWEEN :'b4'::timestamptz + '30 days'
                        AND :'a4'::timestamptz + '30 days' AS kept_30d
  FROM idempotency.keys k WHERE k.scope = 'finish' AND k.key = 'f4';

--
-- A wrong token on a pending key (its current token is another one): 55006.
--
INSERT INTO r SELECT 'f5', * FROM idempotency.idem_claim('f5', scope => 'finish')
RETURNING step, outcome, attempt;
SELECT token AS f5 FROM r WHERE step = 'f5' \gset
SELECT k::text AS f5_row FROM idempotency.keys k WHERE k.scope = 'finish' AND k.key = 'f5' \gset
SELECT idempotency.idem_finish('f5', :f5 + 1000000, 200, NULL, 'finish');
SELECT idempotency.idem_finish('f5', :f5 - 1, 200, NULL, 'finish');
SELECT k::text = :'f5_row' AS unchanged FROM idempotency.keys k
 WHERE k.scope = 'finish' AND k.key = 'f5';
SELECT idempotency.idem_finish('f5', :f5, 200, '42', 'finish') IS NOT NULL AS finished;

--
-- A lease that ended while nobody took the key over or reset it: the token
-- is still current and finish succeeds.  The row lock keeps the background
-- sweeper (which skips locked rows) from resetting it while we sleep.
--
INSERT INTO r SELECT 'f6', * FROM idempotency.idem_claim('f6', '{"slow": true}', 'finish', lease => '1 second')
RETURNING step, outcome, attempt;
SELECT token AS f6 FROM r WHERE step = 'f6' \gset
BEGIN;
SELECT count(*) AS locked
  FROM (SELECT 1 FROM idempotency.keys WHERE scope = 'finish' AND key = 'f6' FOR UPDATE) l;
SELECT pg_sleep(1.1);
SELECT lease_until < clock_timestamp() AS lease_ended, token = :f6 AS not_reset
  FROM idempotency.keys WHERE scope = 'finish' AND key = 'f6';
SELECT idempotency.idem_finish('f6', :f6, 200, '{"late": true}', 'finish') IS NOT NULL AS finished;
COMMIT;
SELECT status, attempt, token = :f6 AS same_token, response_body
  FROM idempotency.keys WHERE scope = 'finish' AND key = 'f6';
INSERT INTO r SELECT 'f6-replay', * FROM idempotency.idem_claim('f6', '{"slow": true}', 'finish')
RETURNING step, outcome, status, response_code, response_body;

-- The same inside one transaction (claim, lease ends, finish, commit).
BEGIN;
INSERT INTO r SELECT 'f7', * FROM idempotency.idem_claim('f7', scope => 'finish', lease => '1 second')
RETURNING step, outcome, attempt;
SELECT pg_sleep(1.1);
SELECT idempotency.idem_finish('f7', token, 200, '{"late": "tx"}', 'finish') IS NOT NULL AS finished
  FROM r WHERE step = 'f7';
COMMIT;
SELECT status, attempt, response_body FROM idempotency.keys WHERE scope = 'finish' AND key = 'f7';

--
-- Response bodies of every JSON type are stored as given.
--
SELECT k.key, k.status, k.response_code, k.response_body
  FROM idempotency.keys k WHERE k.scope = 'finish' ORDER BY k.key;

-- The default scope and the default status.
INSERT INTO r SELECT 'd1', * FROM idempotency.idem_claim('finish:default')
RETURNING step, outcome, attempt;
SELECT idempotency.idem_finish('finish:default', token) IS NOT NULL AS finished FROM r WHERE step = 'd1';
SELECT status, response_code, response_body FROM idempotency.keys
 WHERE scope = '' AND key = 'finish:default';

DELETE FROM idempotency.keys WHERE scope = 'finish' OR (scope = '' AND key = 'finish:default');
