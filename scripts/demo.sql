-- scripts/demo.sql: a guided tour of every outcome of the idempotency
-- extension, run by `./run demo` (psql, superuser, extension created).
-- It plays a shop whose HTTP handler receives retried requests that carry an
-- Idempotency-Key header; scope 'shop' keeps its keys apart from other tenants.
\set ON_ERROR_STOP 1
\pset null '(null)'

\echo
\echo '== 1. claim: the first request with key order-1001 owns the attempt'
\echo '   outcome claimed, a fencing token, attempt 1: run the handler now'
SELECT outcome, token, attempt
  FROM idempotency.idem_claim('order-1001', '{"item": "book", "qty": 1}',
                              scope => 'shop') \gset first_
SELECT :'first_outcome' AS outcome, :first_token AS token, :first_attempt AS attempt;

\echo
\echo '== 2. in_progress: a retry arrives while the first attempt still runs'
\echo '   no token; retry_after = seconds until its lease ends (HTTP 409 + Retry-After)'
SELECT outcome, token, retry_after
  FROM idempotency.idem_claim('order-1001', '{"item": "book", "qty": 1}',
                              scope => 'shop');

\echo
\echo '== 3. finish: the handler stores its response with the token it got'
\echo '   returns when the stored result expires (default retention: 1 day)'
SELECT idempotency.idem_finish('order-1001', :first_token, 201,
                               '{"order_id": 7, "total": 12.50}',
                               scope => 'shop') AS expires_at;

\echo
\echo '== 4. replay: the next retry gets the stored response, the handler does not run'
SELECT outcome, status, response_code, response_body
  FROM idempotency.idem_claim('order-1001', '{"item": "book", "qty": 1}',
                              scope => 'shop');

\echo
\echo '== 5. mismatch: the same key with a different request body (HTTP 422)'
SELECT outcome, token, response_code
  FROM idempotency.idem_claim('order-1001', '{"item": "book", "qty": 2}',
                              scope => 'shop');

\echo
\echo '== 6. takeover: an attempt with a 1 second lease crashes and never finishes'
SELECT outcome, token, attempt
  FROM idempotency.idem_claim('order-1002', '{"item": "pen"}', scope => 'shop',
                              lease => '1 second') \gset old_
SELECT :'old_outcome' AS outcome, :old_token AS token, :old_attempt AS attempt;
\echo '   ... 1.1 seconds pass, the lease runs out, the client retries'
SELECT pg_sleep(1.1) \g /dev/null
SELECT outcome, token, attempt
  FROM idempotency.idem_claim('order-1002', '{"item": "pen"}',
                              scope => 'shop') \gset new_
SELECT :'new_outcome' AS outcome, :new_token AS token, :new_attempt AS attempt,
       :new_token > :old_token AS token_is_larger;
\echo '   the slow first owner wakes up and tries to finish with its old token:'
\set ON_ERROR_STOP 0
SELECT idempotency.idem_finish('order-1002', :old_token, 200, '{"late": true}',
                               scope => 'shop');
\set ON_ERROR_STOP 1
\echo '   -> SQLSTATE' :LAST_ERROR_SQLSTATE '(object_in_use): its token is dead, nothing changed'
\echo '   the new owner finishes normally and retries now replay its result:'
SELECT idempotency.idem_finish('order-1002', :new_token, 200, '{"shipped": true}',
                               scope => 'shop') IS NOT NULL AS finished;
SELECT outcome, status, response_code, response_body
  FROM idempotency.idem_claim('order-1002', '{"item": "pen"}', scope => 'shop');

\echo
\echo '== 7. release: a retryable failure gives the key up without a result'
SELECT outcome, token, attempt
  FROM idempotency.idem_claim('order-1003', '{"item": "mug"}',
                              scope => 'shop') \gset rel_
SELECT :'rel_outcome' AS outcome, :rel_token AS token, :rel_attempt AS attempt;
SELECT idempotency.idem_release('order-1003', :rel_token, scope => 'shop') \g /dev/null
\echo '   released; idem_lookup finds no key:'
SELECT status, attempt FROM idempotency.idem_lookup('order-1003', scope => 'shop');
\echo '   so the next claim is a fresh first attempt, with any payload:'
SELECT outcome, attempt
  FROM idempotency.idem_claim('order-1003', '{"item": "mug", "colour": "blue"}',
                              scope => 'shop');

\echo
\echo '== 8. idem_sweep: expire old results and reset abandoned claims'
\echo '   order-1004 is finished with a 1 second retention,'
\echo '   order-1005 is claimed with a 1 second lease and abandoned'
SELECT token FROM idempotency.idem_claim('order-1004', scope => 'shop') \gset sw_
SELECT idempotency.idem_finish('order-1004', :sw_token, 204, scope => 'shop',
                               retention => '1 second') IS NOT NULL AS finished;
SELECT outcome, attempt
  FROM idempotency.idem_claim('order-1005', scope => 'shop', lease => '1 second');
\echo '   ... 1.1 seconds pass'
SELECT pg_sleep(1.1) \g /dev/null
SELECT * FROM idempotency.idem_sweep();
\echo '   order-1004 is gone, order-1005 is still pending but its token is dead:'
SELECT key, l.status, l.attempt
  FROM (VALUES ('order-1004'), ('order-1005')) AS k(key)
  LEFT JOIN LATERAL idempotency.idem_lookup(k.key, scope => 'shop') AS l ON true
 ORDER BY key;
\echo '   the next claim of order-1005 takes it over as attempt 2:'
SELECT outcome, attempt
  FROM idempotency.idem_claim('order-1005', scope => 'shop');

\echo
\echo 'Tour complete: claimed, in_progress, replay, mismatch, takeover (55006 for'
\echo 'the dead token), release and sweep.'
