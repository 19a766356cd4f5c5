--
-- claim.sql: idem_claim's four outcomes, the columns each one fills, the
-- stored row, request fingerprints, scopes, wait, and token order.
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);

--
-- A new key: claimed, attempt 1, a token; every other column NULL.
--
SELECT clock_timestamp() AS b1 \gset
INSERT INTO r SELECT 'c1', * FROM idempotency.idem_claim('k1', '{"a": 1}', 'claim')
RETURNING step, outcome, token IS NOT NULL AS has_token, attempt, status,
          response_code, response_body, retry_after;
SELECT clock_timestamp() AS a1 \gset
SELECT token AS t1 FROM r WHERE step = 'c1' \gset

-- The stored row: pending, that token, attempt 1, SHA-256 of the request's
-- jsonb text, a 30 s lease and a 1 day retention (the GUC defaults), all
-- measured from the moment of the call.
SELECT k.status, k.token = :t1 AS same_token, k.attempt,
       k.fingerprint = sha256(convert_to('{"a": 1}'::jsonb::text, 'UTF8')) AS fingerprint_sha256,
       k.response_code, k.response_body, k.finished_at,
       k.created_at BETWEEN :'b1' AND :'a1' AS created_now,
       k.lease_until BETWEEN :'b1'::timestamptz + '30 s'
                         AND :'a1'::timestamptz + '30 s' AS lease_30s,
       k.retention,
       k.expires_at BETWEEN :'b1'::timestamptz + '1 day'
                        AND :'a1'::timestamptz + '1 day' AS expires_1d
  FROM idempotency.keys k WHERE k.scope = 'claim' AND k.key = 'k1';

-- The same request while that claim is live: in_progress, only retry_after
-- (whole seconds until the 30 s lease ends, at least 1).
INSERT INTO r SELECT 'c2', * FROM idempotency.idem_claim('k1', '{"a": 1}', 'claim')
RETURNING step, outcome, token, attempt, status, response_code, response_body,
          retry_after BETWEEN 1 AND 30 AS retry_after_in_lease;
-- The same jsonb written with other whitespace and key order is the same
-- request.
INSERT INTO r SELECT 'c3', * FROM idempotency.idem_claim('k1', '  { "a" :1 }  ', 'claim')
RETURNING step, outcome, token, attempt, retry_after IS NOT NULL AS has_retry_after;
-- A different request: mismatch (even while pending), every column NULL.
INSERT INTO r SELECT 'c4', * FROM idempotency.idem_claim('k1', '{"a": 2}', 'claim')
RETURNING step, outcome, token, attempt, status, response_code, response_body, retry_after;
-- No request at all (SQL NULL) is not the same request either.
INSERT INTO r SELECT 'c5', * FROM idempotency.idem_claim('k1', NULL, 'claim')
RETURNING step, outcome, token, attempt, status, response_code, response_body, retry_after;
INSERT INTO r SELECT 'c6', * FROM idempotency.idem_claim('k1', scope => 'claim')
RETURNING step, outcome;

-- Finish, then the same request is a replay of the stored result.
SELECT idempotency.idem_finish('k1', :t1, 201, '{"id": 7, "state": "created"}', 'claim') AS e1 \gset
SELECT k::text AS k1_row FROM idempotency.keys k WHERE k.scope = 'claim' AND k.key = 'k1' \gset
INSERT INTO r SELECT 'c7', * FROM idempotency.idem_claim('k1', '{"a": 1}', 'claim')
RETURNING step, outcome, token, attempt, status, response_code, response_body, retry_after;
INSERT INTO r SELECT 'c8', * FROM idempotency.idem_claim('k1', '{"a":1}', 'claim')
RETURNING step, outcome, status, response_code, response_body;
-- A different request against a finished key is still a mismatch.
INSERT INTO r SELECT 'c9', * FROM idempotency.idem_claim('k1', '{"a": 1, "b": 2}', 'claim')
RETURNING step, outcome, token, attempt, status, response_code, response_body, retry_after;
INSERT INTO r SELECT 'c10', * FROM idempotency.idem_claim('k1', NULL, 'claim')
RETURNING step, outcome, token, attempt, status, response_code, response_body, retry_after;
-- Replays and mismatches changed nothing.
SELECT k::text = :'k1_row' AS unchanged, k.expires_at = :'e1' AS expiry_returned
  FROM idempotency.keys k WHERE k.scope = 'claim' AND k.key = 'k1';

--
-- Fingerprints: jsonb normalises key order and whitespace, but keeps array
-- order, numeric scale and value types.
--
INSERT INTO r SELECT 'fp1', * FROM idempotency.idem_claim('order',
       '{"b": 2, "a": [1, 2], "c": {"y": 1, "x": 2}}', 'claim-fp')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'fp2', * FROM idempotency.idem_claim('order',
       '{"c":{"x":2,"y":1},"a":[1,2],"b":2}', 'claim-fp')
RETURNING step, outcome;
INSERT INTO r SELECT 'fp3', * FROM idempotency.idem_claim('order',
       '{"c":{"x":2,"y":1},"a":[2,1],"b":2}', 'claim-fp')
RETURNING step, outcome;
INSERT INTO r SELECT 'fp4', * FROM idempotency.idem_claim('num', '{"amount": 100}', 'claim-fp')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'fp5', * FROM idempotency.idem_claim('num', '{"amount": 100.0}', 'claim-fp')
RETURNING step, outcome;
INSERT INTO r SELECT 'fp6', * FROM idempotency.idem_claim('num', '{"amount": 1e2}', 'claim-fp')
RETURNING step, outcome;
INSERT INTO r SELECT 'fp7', * FROM idempotency.idem_claim('num', '{"amount": "100"}', 'claim-fp')
RETURNING step, outcome;
INSERT INTO r SELECT 'fp8', * FROM idempotency.idem_claim('num', '{"amount": 100, "extra": null}', 'claim-fp')
RETURNING step, outcome;
-- SQL NULL (no payload) matches only SQL NULL ...
INSERT INTO r SELECT 'fp9', * FROM idempotency.idem_claim('no-payload', NULL, 'claim-fp')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'fp10', * FROM idempotency.idem_claim('no-payload', 'null', 'claim-fp')
RETURNING step, outcome;
INSERT INTO r SELECT 'fp11', * FROM idempotency.idem_claim('no-payload', '{}', 'claim-fp')
RETURNING step, outcome;
INSERT INTO r SELECT 'fp12', * FROM idempotency.idem_claim('no-payload', scope => 'claim-fp')
RETURNING step, outcome;
-- ... and 'null'::jsonb is a payload like any other.
INSERT INTO r SELECT 'fp13', * FROM idempotency.idem_claim('json-null', 'null', 'claim-fp')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'fp14', * FROM idempotency.idem_claim('json-null', NULL, 'claim-fp')
RETURNING step, outcome;
INSERT INTO r SELECT 'fp15', * FROM idempotency.idem_claim('json-null', '"null"', 'claim-fp')
RETURNING step, outcome;
INSERT INTO r SELECT 'fp16', * FROM idempotency.idem_claim('json-null', 'null', 'claim-fp')
RETURNING step, outcome;
SELECT key, fingerprint IS NULL AS no_fingerprint,
       fingerprint = sha256(convert_to(CASE key
                 WHEN 'json-null' THEN 'null'::jsonb
                 WHEN 'num' THEN '{"amount": 100}'::jsonb
                 ELSE '{"b": 2, "a": [1, 2], "c": {"y": 1, "x": 2}}'::jsonb
               END::text, 'UTF8')) AS fingerprint_sha256
  FROM idempotency.keys WHERE scope = 'claim-fp' ORDER BY key;

--
-- Scopes: the same key in different scopes are different keys.
--
INSERT INTO r SELECT 's1', * FROM idempotency.idem_claim('claim:shared', '{"t": "a"}', 'claim-a')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 's2', * FROM idempotency.idem_claim('claim:shared', '{"t": "b"}', 'claim-b')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 's3', * FROM idempotency.idem_claim('claim:shared', '{"t": "default"}')
RETURNING step, outcome, attempt;
SELECT token AS s1 FROM r WHERE step = 's1' \gset
SELECT idempotency.idem_finish('claim:shared', :s1, 200, '{"tenant": "a"}', 'claim-a') IS NOT NULL AS finished_a;
INSERT INTO r SELECT 's4', * FROM idempotency.idem_claim('claim:shared', '{"t": "a"}', 'claim-a')
RETURNING step, outcome, response_code, response_body;
INSERT INTO r SELECT 's5', * FROM idempotency.idem_claim('claim:shared', '{"t": "b"}', 'claim-b')
RETURNING step, outcome, response_code, response_body;
INSERT INTO r SELECT 's6', * FROM idempotency.idem_claim('claim:shared', '{"t": "a"}', 'claim-b')
RETURNING step, outcome;
INSERT INTO r SELECT 's7', * FROM idempotency.idem_claim('claim:shared', '{"t": "default"}', '')
RETURNING step, outcome;
SELECT scope, key, status, attempt FROM idempotency.keys
 WHERE key = 'claim:shared' ORDER BY scope;

--
-- What a replay returns: a 'failed' result, an empty result, a JSON null body.
--
INSERT INTO r SELECT 'f1', * FROM idempotency.idem_claim('k-failed', scope => 'claim')
RETURNING step, outcome, attempt;
SELECT token AS f1 FROM r WHERE step = 'f1' \gset
SELECT idempotency.idem_finish('k-failed', :f1, 503, '{"error": "upstream"}', 'claim', 'failed') IS NOT NULL AS finished;
INSERT INTO r SELECT 'f2', * FROM idempotency.idem_claim('k-failed', scope => 'claim')
RETURNING step, outcome, token, attempt, status, response_code, response_body, retry_after;
INSERT INTO r SELECT 'f3', * FROM idempotency.idem_claim('k-empty', scope => 'claim')
RETURNING step, outcome, attempt;
SELECT token AS f3 FROM r WHERE step = 'f3' \gset
SELECT idempotency.idem_finish('k-empty', :f3, scope => 'claim') IS NOT NULL AS finished;
INSERT INTO r SELECT 'f4', * FROM idempotency.idem_claim('k-empty', scope => 'claim')
RETURNING step, outcome, token, attempt, status, response_code, response_body, retry_after;
INSERT INTO r SELECT 'f5', * FROM idempotency.idem_claim('k-jsonnull', scope => 'claim')
RETURNING step, outcome, attempt;
SELECT token AS f5 FROM r WHERE step = 'f5' \gset
SELECT idempotency.idem_finish('k-jsonnull', :f5, 204, 'null', 'claim') IS NOT NULL AS finished;
INSERT INTO r SELECT 'f6', * FROM idempotency.idem_claim('k-jsonnull', scope => 'claim')
RETURNING step, outcome, status, response_code, response_body,
          response_body IS NULL AS sql_null, response_body = 'null'::jsonb AS json_null;

--
-- A pending key expires greatest(retention after the claim, end of lease).
--
SELECT clock_timestamp() AS b2 \gset
INSERT INTO r SELECT 'e1', * FROM idempotency.idem_claim('k-long-lease', scope => 'claim',
       lease => '2 hours', retention => '1 hour')
RETURNING step, outcome, attempt;
SELECT clock_timestamp() AS a2 \gset
SELECT k.retention, k.expires_at = k.lease_until AS expires_at_lease_end,
       k.lease_until BETWEEN :'b2'::timestamptz + '2 hours'
                         AND :'a2'::timestamptz + '2 hours' AS lease_2h
  FROM idempotency.keys k WHERE k.scope = 'claim' AND k.key = 'k-long-lease';
INSERT INTO r SELECT 'e2', * FROM idempotency.idem_claim('k-long-lease', scope => 'claim')
RETURNING step, outcome, retry_after BETWEEN 7100 AND 7200 AS retry_after_in_lease;

--
-- wait: a claim waits at most "wait" for a live claim, then answers
-- in_progress; when the lease ends while it waits, the waiter takes over.
--
INSERT INTO r SELECT 'w1', * FROM idempotency.idem_claim('k-wait', scope => 'claim')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'w2', * FROM idempotency.idem_claim('k-wait', scope => 'claim', wait => '200 ms')
RETURNING step, outcome, token, retry_after BETWEEN 1 AND 30 AS retry_after_in_lease;
INSERT INTO r SELECT 'w3', * FROM idempotency.idem_claim('k-wait-takeover', scope => 'claim', lease => '1 second')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'w4', * FROM idempotency.idem_claim('k-wait-takeover', scope => 'claim', wait => '30 seconds')
RETURNING step, outcome, token IS NOT NULL AS has_token, attempt;
SELECT k.status, k.attempt, k.token = r.token AS waiter_owns_it
  FROM idempotency.keys k JOIN r ON r.step = 'w4'
 WHERE k.scope = 'claim' AND k.key = 'k-wait-takeover';

--
-- Every claim returned exactly one row; every token is larger than any
-- token issued before it, and only "claimed" carries one.
--
SELECT count(*) AS calls, count(token) AS tokens,
       count(*) FILTER (WHERE outcome = 'claimed') AS claimed
  FROM r;
SELECT bool_and(token > prev) AS strictly_increasing
  FROM (SELECT token, lag(token) OVER (ORDER BY n) AS prev
          FROM r WHERE token IS NOT NULL) s
 WHERE prev IS NOT NULL;
SELECT bool_and((token IS NOT NULL) = (outcome = 'claimed')) AS token_iff_claimed FROM r;

DELETE FROM idempotency.keys
 WHERE scope IN ('claim', 'claim-fp', 'claim-a', 'claim-b')
    OR (scope = '' AND key = 'claim:shared');
