--
-- remember.sql: remembered keys.  A finished key claimed or finished with
-- remember (or under idempotency.remember) keeps a compact record for that
-- long after its retention: a claim of it answers expired (same request)
-- or mismatch (another), never runs again; the sweep drops its response
-- and recovery point and deletes it once remember has passed too;
-- idem_lookup shows it with remembered_until; idem_forget removes a
-- finished key on purpose.  Keys are aged by moving expires_at (and
-- sweep_at) into the past, never by waiting for the clock.
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);
-- the stats checks below want exact key counts whatever the table's size
SET idempotency.stats_exact_limit = -1;
-- a key past its retention: expires_at and sweep_at one second ago
CREATE FUNCTION pg_temp.age(k text) RETURNS void LANGUAGE sql AS $$
	UPDATE idempotency.keys
	   SET expires_at = now() - interval '1 second',
		   sweep_at = least(sweep_at, now() - interval '1 second')
	 WHERE scope = 'remember' AND key = k $$;
-- ... and past its remember too
CREATE FUNCTION pg_temp.age_past_remember(k text) RETURNS void LANGUAGE sql AS $$
	UPDATE idempotency.keys
	   SET expires_at = now() - remember - interval '1 second',
		   sweep_at = now() - interval '1 second'
	 WHERE scope = 'remember' AND key = k $$;

SHOW idempotency.remember;
-- start from a clean slate: whatever expired earlier in this database
SELECT count(*) AS calls FROM idempotency.idem_sweep(NULL);

--
-- off by default: a key past its retention is absent, as in 1.6
--
INSERT INTO r SELECT 'off1', * FROM idempotency.idem_claim('off', '{"v": 1}', 'remember')
RETURNING step, outcome, attempt;
SELECT idempotency.idem_finish('off', token, 200, '{"ok": 1}', 'remember') IS NOT NULL AS finished
  FROM r WHERE step = 'off1';
SELECT remember IS NULL AS not_remembered FROM idempotency.keys
 WHERE scope = 'remember' AND key = 'off';
SELECT status, remembered_until IS NULL AS no_remembered_until
  FROM idempotency.idem_lookup('off', 'remember');
SELECT pg_temp.age('off');
SELECT count(*) AS lookup_rows FROM idempotency.idem_lookup('off', 'remember');
INSERT INTO r SELECT 'off2', * FROM idempotency.idem_claim('off', '{"v": 2}', 'remember')
RETURNING step, outcome, attempt;

--
-- remembered: claim with remember, finish, past retention
--
INSERT INTO r SELECT 'a1', * FROM idempotency.idem_claim('a', '{"v": 1}', 'remember',
	remember => '30 days')
RETURNING step, outcome, attempt;
SELECT token AS a1 FROM r WHERE step = 'a1' \gset
SELECT remember FROM idempotency.keys WHERE scope = 'remember' AND key = 'a';
-- pending: not remembered yet (remembered_until is decided by the finish)
SELECT status, remembered_until IS NULL AS no_remembered_until
  FROM idempotency.idem_lookup('a', 'remember');
SELECT idempotency.idem_checkpoint('a', :a1, 'charged', '{"charge": "ch_1"}', 'remember');
SELECT idempotency.idem_finish('a', :a1, 201, '{"id": 7}', 'remember') IS NOT NULL AS finished;
-- live: replays, and shows when it will be forgotten
INSERT INTO r SELECT 'a2', * FROM idempotency.idem_claim('a', '{"v": 1}', 'remember')
RETURNING step, outcome, status, response_code, response_body;
SELECT status, response_code, response_body, phase,
	   remembered_until = expires_at + interval '30 days' AS remembered_until_ok
  FROM idempotency.idem_lookup('a', 'remember');
SELECT pg_temp.age('a');
-- the same request: expired, with the outcome and nothing else
INSERT INTO r SELECT 'a3', * FROM idempotency.idem_claim('a', '{"v": 1}', 'remember')
RETURNING *;
-- also when it would wait
INSERT INTO r SELECT 'a4', * FROM idempotency.idem_claim('a', '{"v": 1}', 'remember',
	wait => '10 seconds')
RETURNING step, outcome, status, response_code;
-- another request, or none: mismatch
INSERT INTO r SELECT 'a5', * FROM idempotency.idem_claim('a', '{"v": 2}', 'remember')
RETURNING step, outcome, status;
INSERT INTO r SELECT 'a6', * FROM idempotency.idem_claim('a', NULL, 'remember')
RETURNING step, outcome;
-- a batch answers the same
SELECT ord, key, outcome, token IS NOT NULL AS has_token, attempt, status, response_code,
	   response_body
  FROM idempotency.idem_claim_many('{a,b-new}', '{"{\"v\": 1}","{\"v\": 1}"}', 'remember');
-- idem_lookup: the outcome, without the response or the recovery point
SELECT status, attempt, response_code, response_body, phase,
	   finished_at IS NOT NULL AS finished,
	   remembered_until = expires_at + interval '30 days' AS remembered_until_ok
  FROM idempotency.idem_lookup('a', 'remember');
-- the claim's token is as dead as for an absent key (P0002), nothing changes
SELECT k::text AS a_row FROM idempotency.keys k WHERE scope = 'remember' AND key = 'a' \gset
SELECT idempotency.idem_finish('a', :a1, 200, NULL, 'remember');
SELECT idempotency.idem_extend('a', :a1, '1 minute', 'remember');
SELECT idempotency.idem_checkpoint('a', :a1, 'p', NULL, 'remember');
SELECT idempotency.idem_release('a', :a1, 'remember');
SELECT * FROM idempotency.idem_finish_many('{a}', ARRAY[:a1]::bigint[], scope => 'remember');
SELECT k::text = :'a_row' AS unchanged FROM idempotency.keys k
 WHERE scope = 'remember' AND key = 'a';
SELECT count(*) AS claims_that_wrote FROM r WHERE step LIKE 'a%' AND outcome = 'claimed';

--
-- a failed key is remembered as failed
--
INSERT INTO r SELECT 'f1', * FROM idempotency.idem_claim('f', '{"v": 1}', 'remember',
	remember => '1 day')
RETURNING step, outcome;
SELECT idempotency.idem_finish('f', token, 402, '{"error": "declined"}', 'remember',
	status => 'failed') IS NOT NULL AS finished FROM r WHERE step = 'f1';
SELECT pg_temp.age('f');
INSERT INTO r SELECT 'f2', * FROM idempotency.idem_claim('f', '{"v": 1}', 'remember')
RETURNING step, outcome, status, response_code, response_body;

--
-- the setting, and the finish's argument
--
SET idempotency.remember = '1h';
INSERT INTO r SELECT 'g1', * FROM idempotency.idem_claim('g', NULL, 'remember')
RETURNING step, outcome;
SELECT remember FROM idempotency.keys WHERE scope = 'remember' AND key = 'g';
-- an explicit 0 turns it off for this claim
INSERT INTO r SELECT 'g2', * FROM idempotency.idem_claim('g0', NULL, 'remember', remember => '0')
RETURNING step, outcome;
SELECT remember IS NULL AS not_remembered FROM idempotency.keys
 WHERE scope = 'remember' AND key = 'g0';
-- batches take the setting
SELECT ord, outcome FROM idempotency.idem_claim_many('{gm1,gm2}', scope => 'remember');
SELECT key, remember FROM idempotency.keys WHERE scope = 'remember' AND key LIKE 'gm%' ORDER BY key;
RESET idempotency.remember;
-- a finish without remember keeps the claim's, even when the setting changed
SELECT idempotency.idem_finish('g', token, 200, NULL, 'remember') IS NOT NULL AS finished
  FROM r WHERE step = 'g1';
SELECT remember FROM idempotency.keys WHERE scope = 'remember' AND key = 'g';
-- a finish with remember sets it, 0 turns it off
SELECT idempotency.idem_finish('g0', token, 200, NULL, 'remember', remember => '2 days') IS NOT NULL
  AS finished FROM r WHERE step = 'g2';
SELECT remember FROM idempotency.keys WHERE scope = 'remember' AND key = 'g0';
SELECT * FROM idempotency.idem_finish_many('{gm1,gm2}',
	ARRAY(SELECT token FROM idempotency.keys WHERE scope = 'remember' AND key LIKE 'gm%' ORDER BY key),
	scope => 'remember', remember => '0') f
 WHERE f.expires_at IS NULL;
SELECT key, remember IS NULL AS not_remembered FROM idempotency.keys
 WHERE scope = 'remember' AND key LIKE 'gm%' ORDER BY key;
SELECT pg_temp.age('gm1');
INSERT INTO r SELECT 'gm3', * FROM idempotency.idem_claim('gm1', NULL, 'remember')
RETURNING step, outcome, attempt;

--
-- a takeover takes the new claim's remember; a pending key past its
-- retention is absent whatever its remember
--
INSERT INTO r SELECT 't1', * FROM idempotency.idem_claim('t', NULL, 'remember',
	lease => '1 millisecond', remember => '1 day')
RETURNING step, outcome;
UPDATE idempotency.keys SET lease_until = now() - interval '1 second'
 WHERE scope = 'remember' AND key = 't';
INSERT INTO r SELECT 't2', * FROM idempotency.idem_claim('t', NULL, 'remember')
RETURNING step, outcome, attempt;
SELECT remember IS NULL AS not_remembered FROM idempotency.keys
 WHERE scope = 'remember' AND key = 't';
INSERT INTO r SELECT 'p1', * FROM idempotency.idem_claim('p', NULL, 'remember', remember => '1 day')
RETURNING step, outcome;
SELECT pg_temp.age('p');
UPDATE idempotency.keys SET lease_until = now() - interval '1 second'
 WHERE scope = 'remember' AND key = 'p';
INSERT INTO r SELECT 'p2', * FROM idempotency.idem_claim('p', NULL, 'remember')
RETURNING step, outcome, attempt;

--
-- the stats view counts remembered keys (a and f)
--
SELECT remembered FROM idempotency.stats_key_counts();
SELECT remembered FROM idempotency.stats WHERE database = current_database();

--
-- the sweep: compacts a remembered key (its response and recovery point
-- go, its outcome and fingerprint stay), counted as expired; deletes it
-- once remember has passed
--
SELECT key, response_body IS NOT NULL AS has_body, phase FROM idempotency.keys
 WHERE scope = 'remember' AND key IN ('a', 'f') ORDER BY key;
SELECT * FROM idempotency.idem_sweep();
SELECT key, status, response_code, response_body, phase, phase_data,
	   fingerprint IS NOT NULL AS has_fingerprint,
	   sweep_at = expires_at + remember AS sweep_at_ok
  FROM idempotency.keys WHERE scope = 'remember' AND key IN ('a', 'f') ORDER BY key;
-- nothing more to do
SELECT * FROM idempotency.idem_sweep();
INSERT INTO r SELECT 'a7', * FROM idempotency.idem_claim('a', '{"v": 1}', 'remember')
RETURNING step, outcome, status, response_code;
-- past remember: absent, whether or not swept
SELECT pg_temp.age_past_remember('f');
SELECT count(*) AS lookup_rows FROM idempotency.idem_lookup('f', 'remember');
SELECT remembered FROM idempotency.stats_key_counts();
SELECT * FROM idempotency.idem_sweep();
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'remember' AND key = 'f';
INSERT INTO r SELECT 'f3', * FROM idempotency.idem_claim('f', '{"v": 1}', 'remember')
RETURNING step, outcome, attempt;

--
-- idem_forget
--
-- a remembered key: true, and the next claim runs it again
SELECT idempotency.idem_forget('a', 'remember');
INSERT INTO r SELECT 'a8', * FROM idempotency.idem_claim('a', '{"v": 2}', 'remember')
RETURNING step, outcome, attempt;
-- a finished, live key
SELECT idempotency.idem_finish('a', token, 200, NULL, 'remember') IS NOT NULL AS finished
  FROM r WHERE step = 'a8';
SELECT idempotency.idem_forget('a', 'remember');
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'remember' AND key = 'a';
-- absent: false
SELECT idempotency.idem_forget('a', 'remember');
SELECT idempotency.idem_forget('never', 'remember');
-- past its retention and not remembered: false, and the row is left to the sweep
SELECT pg_temp.age('off');
SELECT idempotency.idem_forget('off', 'remember');
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'remember' AND key = 'off';
-- pending: 55000, nothing changes
SELECT k::text AS t_row FROM idempotency.keys k WHERE scope = 'remember' AND key = 't' \gset
SELECT idempotency.idem_forget('t', 'remember');
SELECT k::text = :'t_row' AS unchanged FROM idempotency.keys k
 WHERE scope = 'remember' AND key = 't';
-- the default scope
SELECT idempotency.idem_forget('remember-default-scope');

--
-- bad input
--
SELECT * FROM idempotency.idem_claim('bad', NULL, 'remember', remember => '-1 second');
SELECT * FROM idempotency.idem_claim('bad', NULL, 'remember', remember => '10001 years');
SELECT idempotency.idem_finish('t', 1, remember => '-1 day', scope => 'remember');
SELECT * FROM idempotency.idem_finish_many('{t}', '{1}', scope => 'remember',
	remember => '-1 day');
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'remember' AND key = 'bad';
SELECT idempotency.idem_forget(NULL, 'remember');
SELECT idempotency.idem_forget('', 'remember');
SELECT idempotency.idem_forget('k', NULL);
SELECT idempotency.idem_forget(repeat('k', 256), 'remember');
BEGIN READ ONLY;
SELECT idempotency.idem_forget('t', 'remember');
ROLLBACK;
SET idempotency.remember = '-1';
SHOW idempotency.remember;

--
-- only the table's owner may forget: PUBLIC cannot execute idem_forget
--
CREATE ROLE regress_idem_forgetter;
GRANT USAGE ON SCHEMA idempotency TO regress_idem_forgetter;
SET ROLE regress_idem_forgetter;
SELECT idempotency.idem_forget('t', 'remember');
RESET ROLE;
-- granted, a bound role stays inside its prefix
GRANT EXECUTE ON FUNCTION idempotency.idem_forget(text, text) TO regress_idem_forgetter;
SELECT idempotency.bind_scope('regress_idem_forgetter', 'mine:');
SET ROLE regress_idem_forgetter;
SELECT idempotency.idem_forget('t', 'remember');
SELECT idempotency.idem_forget('t', 'mine:x');
RESET ROLE;
SELECT idempotency.unbind_scope('regress_idem_forgetter');
REVOKE ALL ON FUNCTION idempotency.idem_forget(text, text) FROM regress_idem_forgetter;
REVOKE USAGE ON SCHEMA idempotency FROM regress_idem_forgetter;
DROP ROLE regress_idem_forgetter;

DELETE FROM idempotency.keys WHERE scope = 'remember';
RESET idempotency.stats_exact_limit;
