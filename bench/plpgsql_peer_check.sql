/*
 * bench/plpgsql_peer_check.sql: behavioural checks of the contract, run by
 * bench/run against BOTH the PL/pgSQL peer and the extension before any
 * number is measured, so the comparison is between implementations that
 * give the same answers.  Not the project's test suite (that is sql/,
 * specs/, t/, test/); this is the bench's honesty check.
 *
 *   psql -v ON_ERROR_STOP=1 -v schema=idem_plpgsql -v connstr='...' -f plpgsql_peer_check.sql
 *
 * schema: idem_plpgsql or idempotency (functions are called unqualified
 * through search_path).  connstr: a libpq string for a second session
 * (dblink), used to hold a claim in another open transaction.
 * Needs superuser (idem_sweep, CREATE EXTENSION dblink).
 */
\set ON_ERROR_STOP 1
\set QUIET 1
CREATE EXTENSION IF NOT EXISTS dblink;
SET search_path = :schema, public;
SET client_min_messages = warning;

CREATE FUNCTION pg_temp.check(ok boolean, what text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
	IF ok IS NOT TRUE THEN
		RAISE EXCEPTION 'CHECK FAILED: %', what;
	END IF;
END $$;

CREATE FUNCTION pg_temp.state_of(stmt text) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
	EXECUTE stmt;
	RETURN 'ok';
EXCEPTION WHEN OTHERS THEN
	RETURN SQLSTATE;
END $$;

CREATE FUNCTION pg_temp.expect(stmt text, state text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE got text := pg_temp.state_of(stmt);
BEGIN
	IF got IS DISTINCT FROM state THEN
		RAISE EXCEPTION 'CHECK FAILED: % gave %, expected %', stmt, got, state;
	END IF;
END $$;

CREATE TEMP TABLE tok (name text PRIMARY KEY, token bigint, expires timestamptz);

-- claimed: first claim, token and attempt filled, others NULL
INSERT INTO tok (name, token)
SELECT 'a', token FROM idem_claim('a', '{"amount": 100}', 'check')
 WHERE pg_temp.check(outcome = 'claimed' AND token > 0 AND attempt = 1
	AND status IS NULL AND response_code IS NULL AND response_body IS NULL
	AND retry_after IS NULL, 'first claim is claimed, attempt 1') IS NOT NULL;
SELECT pg_temp.check(count(*) = 1, 'claim a recorded') FROM tok WHERE name = 'a';

-- in_progress: live lease, retry_after between 1 and the lease
SELECT pg_temp.check(outcome = 'in_progress' AND retry_after BETWEEN 1 AND 30
	AND token IS NULL AND attempt IS NULL, 'second claim is in_progress')
  FROM idem_claim('a', '{"amount": 100}', 'check');

-- mismatch, whatever the status; NULL request matches only NULL
SELECT pg_temp.check(outcome = 'mismatch' AND token IS NULL AND retry_after IS NULL,
	'different request is mismatch (pending)')
  FROM idem_claim('a', '{"amount": 101}', 'check');
SELECT pg_temp.check(outcome = 'mismatch', '100 and 100.0 differ')
  FROM idem_claim('a', '{"amount": 100.0}', 'check');
SELECT pg_temp.check(outcome = 'mismatch', 'NULL request vs payload')
  FROM idem_claim('a', NULL, 'check');
SELECT pg_temp.check(outcome = 'in_progress', 'jsonb key order and spaces do not matter')
  FROM idem_claim('a', '{ "amount" :100 }', 'check');

-- finish, replay, repeated finish, wrong token
UPDATE tok SET expires = idem_finish('a', token, 201, '{"id": 7}', 'check') WHERE name = 'a';
SELECT pg_temp.check(expires > now() + interval '23 hours', 'default retention ~1 day') FROM tok WHERE name = 'a';
SELECT pg_temp.check(outcome = 'replay' AND status = 'succeeded' AND response_code = 201
	AND response_body = '{"id": 7}' AND token IS NULL AND attempt IS NULL AND retry_after IS NULL,
	'claim of a finished key is replay')
  FROM idem_claim('a', '{"amount": 100}', 'check');
SELECT pg_temp.check(outcome = 'mismatch', 'mismatch on a finished key')
  FROM idem_claim('a', '{"amount": 5}', 'check');
SELECT pg_temp.check(idem_finish('a', token, 500, NULL, 'check') = expires,
	'repeated finish returns the same expiry')
  FROM tok WHERE name = 'a';
SELECT pg_temp.check(response_code = 201, 'repeated finish changed nothing')
  FROM idem_claim('a', '{"amount": 100}', 'check');
SELECT pg_temp.expect(format('SELECT idem_finish(''a'', %s, 200, NULL, ''check'')', token + 1000000), '55000')
  FROM tok WHERE name = 'a';
SELECT pg_temp.expect(format('SELECT idem_release(''a'', %s, ''check'')', token), '55000') FROM tok WHERE name = 'a';
SELECT pg_temp.expect(format('SELECT idem_extend(''a'', %s, NULL, ''check'')', token), '55000') FROM tok WHERE name = 'a';
SELECT pg_temp.expect('SELECT idem_finish(''absent'', 1, 200, NULL, ''check'')', 'P0002');
SELECT pg_temp.expect('SELECT idem_release(''absent'', 1, ''check'')', 'P0002');
SELECT pg_temp.expect('SELECT idem_extend(''absent'', 1, NULL, ''check'')', 'P0002');
SELECT pg_temp.check(status = 'succeeded' AND attempt = 1 AND response_code = 201, 'lookup')
  FROM idem_lookup('a', 'check');
SELECT pg_temp.check(count(*) = 0, 'scope separates keys') FROM idem_lookup('a', 'other');

-- failed is terminal and replayed; shorter retention for it
INSERT INTO tok (name, token) SELECT 'f', token FROM idem_claim('f', NULL, 'check');
SELECT pg_temp.check(idem_finish('f', token, 402, '{"e": 1}', 'check', 'failed', '1 hour')
	< now() + interval '2 hours', 'finish retention') FROM tok WHERE name = 'f';
SELECT pg_temp.check(outcome = 'replay' AND status = 'failed' AND response_code = 402, 'failed replays')
  FROM idem_claim('f', NULL, 'check');
SELECT pg_temp.check(outcome = 'mismatch', '''null''::jsonb is a payload, not NULL')
  FROM idem_claim('f', 'null', 'check');

-- takeover after the lease: attempt + 1, larger token, old token dead
INSERT INTO tok (name, token) SELECT 't1', token FROM idem_claim('t', '[1]', 'check', '20 ms');
SELECT pg_sleep(0.1);
INSERT INTO tok (name, token)
SELECT 't2', c.token FROM idem_claim('t', '[1]', 'check') c, tok o
 WHERE o.name = 't1'
   AND pg_temp.check(c.outcome = 'claimed' AND c.attempt = 2 AND c.token > o.token,
					 'takeover after the lease') IS NOT NULL;
SELECT pg_temp.check(count(*) = 1, 'takeover recorded') FROM tok WHERE name = 't2';
SELECT pg_temp.expect(format('SELECT idem_finish(''t'', %s, 200, NULL, ''check'')', token), '55006') FROM tok WHERE name = 't1';
SELECT pg_temp.expect(format('SELECT idem_extend(''t'', %s, NULL, ''check'')', token), '55006') FROM tok WHERE name = 't1';
SELECT pg_temp.expect(format('SELECT idem_release(''t'', %s, ''check'')', token), '55006') FROM tok WHERE name = 't1';
SELECT pg_temp.check(idem_extend('t', token, '1 hour', 'check') > now() + interval '59 minutes', 'extend')
  FROM tok WHERE name = 't2';
SELECT pg_temp.check(retry_after > 3000, 'extended lease seen by in_progress')
  FROM idem_claim('t', '[1]', 'check');
SELECT pg_temp.check(idem_finish('t', token, 200, NULL, 'check') IS NOT NULL, 'new owner finishes')
  FROM tok WHERE name = 't2';

-- an expired lease nobody took over is still current for its owner
INSERT INTO tok (name, token) SELECT 'e', token FROM idem_claim('e', NULL, 'check', '10 ms');
SELECT pg_sleep(0.05);
SELECT pg_temp.check(idem_finish('e', token, 200, NULL, 'check') IS NOT NULL, 'late finish, not taken over')
  FROM tok WHERE name = 'e';

-- release: the key disappears, next claim is a first attempt with any payload
INSERT INTO tok (name, token) SELECT 'r', token FROM idem_claim('r', '"x"', 'check');
SELECT idem_release('r', token, 'check') FROM tok WHERE name = 'r';
SELECT pg_temp.check(count(*) = 0, 'released key is absent') FROM idem_lookup('r', 'check');
SELECT pg_temp.check(c.outcome = 'claimed' AND c.attempt = 1 AND c.token > o.token, 'claim after release')
  FROM idem_claim('r', '"y"', 'check') c, tok o WHERE o.name = 'r';

-- one transaction: the own open claim answers in_progress at once, even with wait
BEGIN;
INSERT INTO tok (name, token) SELECT 'x', token FROM idem_claim('x', NULL, 'check');
SELECT pg_temp.check(outcome = 'in_progress', 'own open claim is in_progress')
  FROM idem_claim('x', NULL, 'check', NULL, NULL, '20 s');
SELECT pg_temp.check(clock_timestamp() - now() < interval '10 s', 'own claim did not wait for itself');
ROLLBACK;
SELECT pg_temp.check(count(*) = 0, 'rollback leaves no trace') FROM idem_lookup('x', 'check');
SELECT pg_temp.check(outcome = 'claimed' AND attempt = 1 AND token > (SELECT max(token) FROM tok),
	'claim after rollback: new larger token') FROM idem_claim('x', NULL, 'check');

BEGIN;
SAVEPOINT s;
SELECT outcome FROM idem_claim('sp', NULL, 'check');
ROLLBACK TO SAVEPOINT s;
SELECT pg_temp.check(count(*) = 0, 'rollback to savepoint leaves no trace') FROM idem_lookup('sp', 'check');
SELECT pg_temp.check(outcome = 'claimed', 'claim after savepoint rollback') FROM idem_claim('sp', NULL, 'check');
COMMIT;

-- all in one transaction: claim, business write, finish
BEGIN;
CREATE TEMP TABLE biz (v int);
INSERT INTO tok (name, token) SELECT 'b', token FROM idem_claim('b', NULL, 'check');
INSERT INTO biz VALUES (1);
SELECT idem_finish('b', token, 200, '{}', 'check') FROM tok WHERE name = 'b';
COMMIT;
SELECT pg_temp.check(outcome = 'replay', 'in-transaction claim + finish') FROM idem_claim('b', NULL, 'check');

-- another session's uncommitted claim: in_progress, retry_after 1, no waiting
SELECT dblink_connect('other', :'connstr');
SELECT dblink_exec('other', 'SET search_path = ' || :'schema');
SELECT dblink_exec('other', 'BEGIN');
SELECT pg_temp.check(o = 'claimed', 'other session claims in its open transaction')
  FROM dblink('other', $q$SELECT outcome FROM idem_claim('u', NULL, 'check')$q$) AS t(o text);
SELECT pg_temp.check(outcome = 'in_progress' AND retry_after = 1, 'uncommitted claim: in_progress, retry_after 1')
  FROM idem_claim('u', NULL, 'check');
SELECT pg_temp.check(clock_timestamp() - statement_timestamp() < interval '1 s', 'did not wait');
SELECT dblink_exec('other', 'COMMIT');
SELECT pg_temp.check(outcome = 'in_progress' AND retry_after > 1, 'committed live claim')
  FROM idem_claim('u', NULL, 'check');
-- wait: a claim with wait returns as soon as the other attempt settles
SELECT dblink_exec('other', 'BEGIN');
CREATE TEMP TABLE otok (token bigint);
INSERT INTO otok SELECT t FROM dblink('other', $q$SELECT token FROM idem_claim('w', '1', 'check')$q$) AS x(t bigint);
SELECT dblink_exec('other', 'COMMIT');
SELECT pg_temp.check(outcome = 'in_progress', 'wait => 0 does not wait') FROM idem_claim('w', '1', 'check');
SELECT dblink_send_query('other',
	format($q$SELECT pg_sleep(0.3)::text, idem_finish('w', %s, 200, '{"w": 1}', 'check')$q$, token))
  FROM otok;
SELECT pg_temp.check(outcome = 'replay' AND response_body = '{"w": 1}',
	'wait returns the result once the other attempt finished')
  FROM idem_claim('w', '1', 'check', NULL, NULL, '20 s');
SELECT pg_temp.check(clock_timestamp() - statement_timestamp() < interval '10 s', 'woke before the deadline');
SELECT count(*) FROM dblink_get_result('other') AS t(a text, b timestamptz);
SELECT dblink_disconnect('other');

-- past its retention a key behaves as absent, before any sweep
INSERT INTO tok (name, token) SELECT 'y', token FROM idem_claim('y', NULL, 'check', '10 ms', '10 ms');
SELECT pg_sleep(0.05);
SELECT pg_temp.check(count(*) = 0, 'expired pending key is absent for lookup') FROM idem_lookup('y', 'check');
SELECT pg_temp.expect(format('SELECT idem_finish(''y'', %s, 200, NULL, ''check'')', token), 'P0002') FROM tok WHERE name = 'y';
SELECT pg_temp.check(outcome = 'claimed' AND attempt = 1, 'expired key: fresh first attempt')
  FROM idem_claim('y', '{"other": true}', 'check', '10 ms', '10 ms');

-- sweep: expires finished keys past retention, resets stale pending ones
INSERT INTO tok (name, token) SELECT 's', token FROM idem_claim('s', NULL, 'check');
SELECT idem_finish('s', token, 200, NULL, 'check', 'succeeded', '10 ms') FROM tok WHERE name = 's';
INSERT INTO tok (name, token) SELECT 'z', token FROM idem_claim('z', NULL, 'check', '10 ms');
SELECT pg_sleep(0.05);
SELECT pg_temp.check(expired >= 2 AND reset >= 1, 'sweep expired s and y, reset z') FROM idem_sweep(1000);
SELECT pg_temp.check(count(*) = 0, 'swept key is gone') FROM idem_lookup('s', 'check');
SELECT pg_temp.check(status = 'pending' AND attempt = 1, 'reset key still exists') FROM idem_lookup('z', 'check');
SELECT pg_temp.expect(format('SELECT idem_finish(''z'', %s, 200, NULL, ''check'')', token), '55006') FROM tok WHERE name = 'z';
SELECT pg_temp.check(outcome = 'claimed' AND attempt = 2, 'claim after reset is a takeover')
  FROM idem_claim('z', NULL, 'check');
SELECT pg_temp.check(expired = 0 AND reset = 0, 'nothing left to sweep') FROM idem_sweep(1000);

-- bad input
SELECT pg_temp.expect('SELECT * FROM idem_claim(NULL)', '22004');
SELECT pg_temp.expect('SELECT * FROM idem_claim(''k'', NULL, NULL)', '22004');
SELECT pg_temp.expect('SELECT * FROM idem_claim(''k'', NULL, '''', NULL, NULL, NULL)', '22004');
SELECT pg_temp.expect('SELECT * FROM idem_claim('''')', '22023');
SELECT pg_temp.expect(format('SELECT * FROM idem_claim(%L)', repeat('k', 256)), '22001');
SELECT pg_temp.expect(format('SELECT * FROM idem_claim(''k'', NULL, %L)', repeat('s', 256)), '22001');
SELECT pg_temp.expect('SELECT * FROM idem_claim(''k'', NULL, '''', ''0 s'')', '22023');
SELECT pg_temp.expect('SELECT * FROM idem_claim(''k'', NULL, '''', NULL, ''-1 s'')', '22023');
SELECT pg_temp.expect('SELECT * FROM idem_claim(''k'', NULL, '''', NULL, NULL, ''-1 s'')', '22023');
SELECT pg_temp.expect('SELECT idem_finish(''k'', NULL)', '22004');
SELECT pg_temp.expect('SELECT idem_finish(''k'', 1, 200, NULL, '''', NULL)', '22004');
SELECT pg_temp.expect('SELECT idem_finish(''k'', 1, 200, NULL, '''', ''done'')', '22023');
SELECT pg_temp.expect('SELECT idem_finish(''k'', 1, 200, NULL, '''', ''succeeded'', ''0 s'')', '22023');
SELECT pg_temp.expect('SELECT * FROM idem_sweep(0)', '22023');
INSERT INTO tok (name, token) SELECT 'big', token FROM idem_claim('big', NULL, 'check');
SELECT pg_temp.expect(format('SELECT idem_finish(''big'', %s, 200, jsonb_build_object(''b'', repeat(''x'', 1100000)), ''check'')', token), '54000')
  FROM tok WHERE name = 'big';
SELECT pg_temp.check(status = 'pending', 'oversized finish changed nothing') FROM idem_lookup('big', 'check');

-- a consumer batch of 10,000 keys in one transaction (no lock table exhaustion)
DO $$
DECLARE
	t bigint;
	n int := 0;
BEGIN
	FOR i IN 1..10000 LOOP
		SELECT c.token INTO t FROM idem_claim('batch-' || i, NULL, 'check') c WHERE c.outcome = 'claimed';
		IF t IS NOT NULL THEN
			PERFORM idem_finish('batch-' || i, t, 200, NULL, 'check');
			n := n + 1;
		END IF;
	END LOOP;
	PERFORM pg_temp.check(n = 10000, '10,000 claims and finishes in one transaction');
END $$;

-- tokens only grow
SELECT pg_temp.check(bool_and(token > 0), 'tokens are positive') FROM tok;

\echo checks passed for :schema
