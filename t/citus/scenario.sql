-- The outcomes every client call gives, as one psql script: 301_citus_outcomes.pl
-- runs it on a single server and through a Citus coordinator and compares
-- the two outputs line by line.  Tokens differ between the two, so only
-- facts about them are printed.  After every statement, its SQLSTATE.
-- Every call has the shape Citus delegates to the node that holds the
-- scope: SELECT f(...) or SELECT ... FROM f(...) alone.
\set VERBOSITY sqlstate
\pset format unaligned
\pset tuples_only on
\set pause 'SELECT pg_sleep(0.01);'

-- a first claim, a duplicate while it runs, a different payload
SELECT outcome, attempt, token AS ta FROM idempotency.idem_claim('a', '{"x": 1}', scope => 'sc1') \gset
\echo claim a: :outcome :attempt :SQLSTATE
SELECT outcome, token IS NULL, attempt IS NULL, retry_after > 0 FROM idempotency.idem_claim('a', '{"x": 1}', scope => 'sc1');
\echo :SQLSTATE
SELECT outcome FROM idempotency.idem_claim('a', '{"x": 2}', scope => 'sc1');
\echo :SQLSTATE
-- lease, recovery point, finish, replay
SELECT e > now() FROM idempotency.idem_extend('a', :ta, '1 min', scope => 'sc1') e;
\echo :SQLSTATE
SELECT idempotency.idem_extend('a', :ta + 1, '1 min', scope => 'sc1');
\echo extend with a wrong token: :SQLSTATE
SELECT idempotency.idem_checkpoint('a', :ta, 'charged', '{"charge": "ch_1"}', scope => 'sc1');
\echo :SQLSTATE
SELECT e > now() FROM idempotency.idem_finish('a', :ta, 201, '{"id": 7}', scope => 'sc1') e;
\echo :SQLSTATE
SELECT e > now() FROM idempotency.idem_finish('a', :ta, 201, '{"id": 7}', scope => 'sc1') e;
\echo finish twice with its token: :SQLSTATE
SELECT e IS NOT NULL FROM idempotency.idem_finish('a', :ta, 500, scope => 'sc1') e;
\echo finish again with another result: :SQLSTATE
SELECT outcome, status, response_code, response_body FROM idempotency.idem_claim('a', '{"x": 1}', scope => 'sc1');
\echo :SQLSTATE
SELECT outcome, status, response_code FROM idempotency.idem_claim('a', '{"x": 2}', scope => 'sc1');
\echo :SQLSTATE
SELECT status, attempt, response_code, response_body, phase FROM idempotency.idem_lookup('a', scope => 'sc1');
\echo :SQLSTATE
SELECT count(*) FROM idempotency.idem_lookup('nobody', scope => 'sc1');
\echo :SQLSTATE
SELECT idempotency.idem_extend('a', :ta, '1 min', scope => 'sc1');
\echo extend a finished key: :SQLSTATE
SELECT idempotency.idem_checkpoint('a', :ta, 'late', scope => 'sc1');
\echo checkpoint a finished key: :SQLSTATE
-- a failure is stored and replayed as one
SELECT token AS tg FROM idempotency.idem_claim('g', scope => 'sc1') \gset
SELECT status, attempt FROM idempotency.idem_lookup('g', scope => 'sc1');
SELECT e IS NOT NULL FROM idempotency.idem_finish('g', :tg, 502, '{"error": "upstream"}', scope => 'sc1', status => 'failed') e;
\echo :SQLSTATE
SELECT outcome, status, response_code, response_body FROM idempotency.idem_claim('g', scope => 'sc1');
SELECT idempotency.idem_finish('g', :tg, 200, scope => 'sc1', status => 'maybe');
\echo an unknown status: :SQLSTATE
-- the same key in another scope is another key
SELECT outcome, attempt FROM idempotency.idem_claim('a', scope => 'sc2');
\echo :SQLSTATE

-- a takeover after the lease ends, resuming from the recovery point
SELECT token AS tb FROM idempotency.idem_claim('b', scope => 'sc1', lease => '1 ms') \gset
SELECT idempotency.idem_checkpoint('b', :tb, 'reserved', scope => 'sc1');
:pause
SELECT outcome, attempt, token AS tb2, phase FROM idempotency.idem_claim('b', scope => 'sc1') \gset
\echo takeover b: :outcome :attempt :phase :SQLSTATE
SELECT :tb2 > :tb AS token_grew;
SELECT idempotency.idem_finish('b', :tb, 200, scope => 'sc1');
\echo finish with the old token: :SQLSTATE
SELECT idempotency.idem_release('b', :tb2, scope => 'sc1');
\echo :SQLSTATE
SELECT count(*) FROM idempotency.idem_lookup('b', scope => 'sc1');
SELECT idempotency.idem_release('b', :tb2, scope => 'sc1');
\echo release twice: :SQLSTATE

-- the sweep: one key past its retention, one whose lease ended
SELECT 1 FROM idempotency.idem_claim('c', scope => 'sc3', lease => '1 ms', retention => '1 ms');
SELECT token AS td FROM idempotency.idem_claim('d', scope => 'sc4', lease => '1 ms') \gset
:pause
SELECT expired, reset FROM idempotency.idem_sweep();
\echo :SQLSTATE
SELECT count(*) FROM idempotency.idem_lookup('c', scope => 'sc3');
SELECT status, attempt FROM idempotency.idem_lookup('d', scope => 'sc4');
SELECT outcome, attempt, token AS td2 FROM idempotency.idem_claim('d', scope => 'sc4') \gset
\echo claim d after its reset: :outcome :attempt
SELECT :td2 > :td AS token_grew;
SELECT expired, reset FROM idempotency.idem_sweep();

-- batches
SELECT ord, key, outcome, attempt FROM idempotency.idem_claim_many(ARRAY['m1', 'm2', 'm1', 'a'], scope => 'sc1');
\echo :SQLSTATE
SELECT array_agg(token ORDER BY key) AS mt FROM idempotency.idem_claim_many(ARRAY['m3', 'm4'], scope => 'sc1') \gset
SELECT ord, key, expires_at > now() FROM idempotency.idem_finish_many(ARRAY['m3', 'm4'], :'mt'::bigint[], ARRAY[200, 202], scope => 'sc1');
\echo :SQLSTATE
SELECT ord FROM idempotency.idem_finish_many(ARRAY['m3', 'm4'], :'mt'::bigint[], scope => 'sc1');
\echo finish a batch twice: :SQLSTATE
SELECT ord FROM idempotency.idem_finish_many(ARRAY['m3'], ARRAY[1, 2]::bigint[], scope => 'sc1');
\echo arrays of different lengths: :SQLSTATE
SELECT array_agg(token ORDER BY key) AS mt2 FROM idempotency.idem_claim_many(ARRAY['m5', 'm6'], scope => 'sc1') \gset
SELECT '{' || (:'mt2'::bigint[])[1] || ', 1}' AS bad \gset
SELECT ord FROM idempotency.idem_finish_many(ARRAY['m5', 'm6'], :'bad'::bigint[], scope => 'sc1');
\echo a batch with one wrong token: :SQLSTATE
SELECT status FROM idempotency.idem_lookup('m5', scope => 'sc1');
SELECT outcome, response_code FROM idempotency.idem_claim('m4', scope => 'sc1');

-- everything in one transaction: a rolled-back claim leaves nothing
BEGIN;
SELECT outcome, attempt FROM idempotency.idem_claim('e', scope => 'sc5');
SELECT outcome, retry_after FROM idempotency.idem_claim('e', scope => 'sc5');
ROLLBACK;
SELECT count(*) FROM idempotency.idem_lookup('e', scope => 'sc5');
BEGIN;
SELECT token AS tf FROM idempotency.idem_claim('f', scope => 'sc5') \gset
SELECT e > now() FROM idempotency.idem_finish('f', :tf, 200, '"done"', scope => 'sc5') e;
COMMIT;
SELECT outcome, response_body FROM idempotency.idem_claim('f', scope => 'sc5');

-- bad input
SELECT idempotency.idem_claim(NULL, scope => 'sc1');
\echo null key: :SQLSTATE
SELECT idempotency.idem_claim('', scope => 'sc1');
\echo empty key: :SQLSTATE
SELECT idempotency.idem_claim('k', scope => repeat('s', 256));
\echo long scope: :SQLSTATE
SELECT idempotency.idem_claim('k', scope => 'sc1', lease => '-1 s');
\echo negative lease: :SQLSTATE
SELECT idempotency.idem_finish('nobody', 1, 200, scope => 'sc1');
\echo finish of an unknown key: :SQLSTATE
SELECT outcome FROM idempotency.idem_claim('k', '[1, 2]', scope => 'sc1');
\echo :SQLSTATE

-- what is stored
SELECT scope, key, status, attempt, response_code, response_body, phase, token IS NOT NULL
  FROM idempotency.keys WHERE scope LIKE 'sc_' ORDER BY scope, key;
