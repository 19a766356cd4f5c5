--
-- abandoned.sql: completers.  A claim may keep its request with the key
-- (keep_request) until the key is finished; idem_claim_abandoned takes
-- over the keys of a scope whose attempt was abandoned (lease ended, reset
-- by a sweep, or the session-bound owner's session gone), oldest key
-- first, each exactly as a claim's takeover, and returns the kept request
-- and the last recovery point.  Leases are ended by moving lease_until
-- (and sweep_at) into the past, never by waiting for the clock.  The
-- sweep's notification is checked by the isolation specs, which print
-- notifications without a process id.
--
\set VERBOSITY sqlstate
SET idempotency.stats_exact_limit = -1;
-- end the lease of a key of scope "abandoned"
CREATE FUNCTION pg_temp.end_lease(k text, ago interval DEFAULT '1 minute')
RETURNS void LANGUAGE sql AS $$
	UPDATE idempotency.keys
	   SET lease_until = now() - ago,
		   sweep_at = least(sweep_at, now() - ago)
	 WHERE scope = 'abandoned' AND key = k $$;
CREATE FUNCTION pg_temp.stored(k text)
RETURNS TABLE (status text, attempt int, request jsonb, phase text,
			   owner_session boolean, reset boolean)
LANGUAGE sql AS $$
	SELECT status, attempt, request, phase, owner_session IS NOT NULL,
		   token IS NULL
	  FROM idempotency.keys WHERE scope = 'abandoned' AND key = k $$;
CREATE TEMP TABLE t (step text PRIMARY KEY, token bigint);
SELECT coalesce(sum(abandoned_takeovers), 0) AS counted_before FROM idempotency.stats \gset

--
-- keep_request: stored with a claim that asks for it, and only then
--
SELECT outcome, attempt FROM idempotency.idem_claim('plain', '{"n": 1}', 'abandoned');
SELECT request FROM pg_temp.stored('plain');
WITH c AS (SELECT * FROM idempotency.idem_claim('a', '{"amount": 100}', 'abandoned',
	lease => '1 hour', keep_request => true))
INSERT INTO t SELECT 'a1', token FROM c RETURNING step, token > 0 AS has_token;
SELECT * FROM pg_temp.stored('a');
-- no request: nothing to keep, and no error
SELECT outcome FROM idempotency.idem_claim('nullreq', NULL, 'abandoned', keep_request => true);
SELECT request IS NULL AS none_kept FROM pg_temp.stored('nullreq');
-- keep_request NULL is false
SELECT outcome FROM idempotency.idem_claim('nullkeep', '{"n": 1}', 'abandoned', keep_request => NULL);
SELECT request IS NULL AS none_kept FROM pg_temp.stored('nullkeep');

--
-- a live lease is not abandoned
--
SELECT count(*) AS taken FROM idempotency.idem_claim_abandoned('abandoned', 10);

--
-- its lease ends: a completer takes it over, with the request and the
-- recovery point, as a takeover (attempt 2, a new token, the old one dead)
--
SELECT idempotency.idem_checkpoint('a', token, 'charged', '{"charge": "ch_1"}', 'abandoned')
  FROM t WHERE step = 'a1';
SELECT pg_temp.end_lease('a');
WITH c AS (SELECT * FROM idempotency.idem_claim_abandoned('abandoned', 10, '1 hour'))
INSERT INTO t SELECT 'a2', c.token FROM c
RETURNING step;
SELECT key, attempt, request, phase, phase_data,
	   token = (SELECT token FROM t WHERE step = 'a2') AS token_returned
  FROM idempotency.keys WHERE scope = 'abandoned' AND key = 'a';
SELECT (SELECT token FROM t WHERE step = 'a2') > (SELECT token FROM t WHERE step = 'a1')
	AS newer_token;
SELECT lease_until > now() + interval '59 minutes' AS leased_an_hour,
	   expires_at >= lease_until AS expires_after_lease
  FROM idempotency.keys WHERE scope = 'abandoned' AND key = 'a';
-- the abandoned attempt's token is dead
SELECT idempotency.idem_finish('a', token, 200, '{"late": true}', 'abandoned')
  FROM t WHERE step = 'a1';
SELECT idempotency.idem_extend('a', token, scope => 'abandoned') FROM t WHERE step = 'a1';
-- taken over, it is live again: nobody else takes it, and a retry waits
SELECT count(*) AS taken FROM idempotency.idem_claim_abandoned('abandoned', 10);
SELECT outcome, retry_after > 1 AS retry_later
  FROM idempotency.idem_claim('a', '{"amount": 100}', 'abandoned');
-- the completer finishes: the request goes, and a retry gets the replay
SELECT idempotency.idem_finish('a', token, 201, '{"order": 1}', 'abandoned') IS NOT NULL AS finished
  FROM t WHERE step = 'a2';
SELECT * FROM pg_temp.stored('a');
SELECT outcome, response_code, response_body
  FROM idempotency.idem_claim('a', '{"amount": 100}', 'abandoned');
SELECT count(*) AS taken FROM idempotency.idem_claim_abandoned('abandoned', 10);

--
-- the columns when nothing was kept and no recovery point recorded
--
SELECT pg_temp.end_lease('plain');
SELECT key, attempt, request IS NULL AS no_request, phase IS NULL AS no_phase,
	   phase_data IS NULL AS no_phase_data
  FROM idempotency.idem_claim_abandoned('abandoned');
SELECT idempotency.idem_release('plain', token, 'abandoned')
  FROM idempotency.keys WHERE scope = 'abandoned' AND key = 'plain';
SELECT idempotency.idem_release(k, token, 'abandoned')
  FROM idempotency.keys, unnest(ARRAY['nullreq', 'nullkeep']) k
 WHERE scope = 'abandoned' AND key = k;

--
-- oldest key first (its first claim; not its lease's end), at most
-- max_keys per call
--
SELECT count(*) AS claimed FROM unnest(ARRAY['o1', 'o2', 'o3']) k,
	idempotency.idem_claim(k, jsonb_build_object('k', k), 'abandoned', keep_request => true) c
 WHERE c.outcome = 'claimed';
UPDATE idempotency.keys
   SET created_at = now() - CASE key WHEN 'o2' THEN interval '3 hours'
									WHEN 'o3' THEN interval '2 hours'
									ELSE interval '1 hour' END
 WHERE scope = 'abandoned' AND key IN ('o1', 'o2', 'o3');
SELECT pg_temp.end_lease('o1', '3 minutes'), pg_temp.end_lease('o2', '1 minute'),
	   pg_temp.end_lease('o3', '2 minutes');
SELECT key, attempt, request FROM idempotency.idem_claim_abandoned('abandoned', 2);
SELECT key, attempt, request FROM idempotency.idem_claim_abandoned('abandoned', 2);
SELECT count(*) AS taken FROM idempotency.idem_claim_abandoned('abandoned', 2);
-- another scope's keys are not this scope's
SELECT pg_temp.end_lease(k) FROM unnest(ARRAY['o1', 'o2', 'o3']) k;
SELECT count(*) AS taken FROM idempotency.idem_claim_abandoned('abandoned-other', 10);
SELECT count(*) AS taken FROM idempotency.idem_claim_abandoned('', 10);

--
-- a key a sweep reset (token NULL) is found, and keeps its request
--
SELECT count(*) > 0 AS swept FROM idempotency.idem_sweep(NULL) WHERE reset >= 3;
SELECT key, reset, request FROM pg_temp.stored('o1'), (VALUES ('o1')) v(key)
UNION ALL SELECT 'o2', reset, request FROM pg_temp.stored('o2')
UNION ALL SELECT 'o3', reset, request FROM pg_temp.stored('o3');
SELECT key, attempt, request FROM idempotency.idem_claim_abandoned('abandoned', 10);
SELECT count(*) AS reset_left FROM idempotency.keys
 WHERE scope = 'abandoned' AND token IS NULL;

--
-- a client's retry takes over as before: without keep_request the kept
-- request stays, with it the request is the retry's (the same: the
-- fingerprints match)
--
SELECT pg_temp.end_lease('o1');
SELECT outcome, attempt FROM idempotency.idem_claim('o1', '{"k": "o1"}', 'abandoned');
SELECT attempt, request FROM pg_temp.stored('o1');
SELECT pg_temp.end_lease('o1');
SELECT outcome, attempt FROM idempotency.idem_claim('o1', '{"k": "o1"}', 'abandoned',
	keep_request => true);
SELECT attempt, request FROM pg_temp.stored('o1');
-- finish_many drops the kept requests too
SELECT count(*) AS finished FROM idempotency.idem_finish_many(
	ARRAY['o1', 'o2', 'o3'],
	ARRAY(SELECT token FROM idempotency.keys WHERE scope = 'abandoned'
		   AND key IN ('o1', 'o2', 'o3') ORDER BY key),
	scope => 'abandoned');
SELECT count(*) AS requests_kept FROM idempotency.keys
 WHERE scope = 'abandoned' AND request IS NOT NULL;

--
-- past its retention a pending key is absent: nobody takes it over, and a
-- fresh claim of it starts over without the old request
--
SELECT outcome FROM idempotency.idem_claim('gone', '{"n": 1}', 'abandoned', keep_request => true);
UPDATE idempotency.keys SET lease_until = now() - interval '2 minutes',
	   expires_at = now() - interval '1 minute', sweep_at = now() - interval '1 minute'
 WHERE scope = 'abandoned' AND key = 'gone';
SELECT count(*) AS taken FROM idempotency.idem_claim_abandoned('abandoned', 10);
SELECT outcome, attempt FROM idempotency.idem_claim('gone', '{"n": 1}', 'abandoned');
SELECT attempt, request IS NULL AS none_kept FROM pg_temp.stored('gone');
SELECT idempotency.idem_release('gone', token, 'abandoned')
  FROM idempotency.keys WHERE scope = 'abandoned' AND key = 'gone';

--
-- what the key was claimed with stays: retention and remember
--
SELECT outcome FROM idempotency.idem_claim('kept', '{"n": 1}', 'abandoned',
	retention => '3 days', remember => '30 days', keep_request => true);
SELECT pg_temp.end_lease('kept');
SELECT key, attempt FROM idempotency.idem_claim_abandoned('abandoned', 1, '5 minutes');
SELECT retention, remember, expires_at > now() + interval '2 days 23 hours' AS retained
  FROM idempotency.keys WHERE scope = 'abandoned' AND key = 'kept';

--
-- a session-bound key whose session is gone is abandoned at once, lease or
-- not; the completer's claim is bound to no session.  (No session holds
-- the binding 1.)
--
SELECT outcome FROM idempotency.idem_claim('bound', '{"n": 1}', 'abandoned',
	lease => '1 hour', session_bound => true, keep_request => true);
SELECT count(*) AS taken FROM idempotency.idem_claim_abandoned('abandoned', 10);
UPDATE idempotency.keys SET owner_session = 1
 WHERE scope = 'abandoned' AND key = 'bound';
SELECT key, attempt, request FROM idempotency.idem_claim_abandoned('abandoned', 10);
SELECT owner_session, attempt FROM pg_temp.stored('bound');

--
-- this transaction's own claim is never taken over, even with its lease
-- over (it is still running here)
--
BEGIN;
SELECT outcome FROM idempotency.idem_claim('mine', '{"n": 1}', 'abandoned', keep_request => true);
SELECT pg_temp.end_lease('mine');
SELECT count(*) AS taken FROM idempotency.idem_claim_abandoned('abandoned', 10);
ROLLBACK;
-- a key taken over in an open transaction is this transaction's claim
BEGIN;
SELECT outcome FROM idempotency.idem_claim('open', '{"n": 1}', 'abandoned');
COMMIT;
SELECT pg_temp.end_lease('open');
BEGIN;
SELECT key, attempt FROM idempotency.idem_claim_abandoned('abandoned', 10);
SELECT outcome FROM idempotency.idem_claim('open', '{"n": 1}', 'abandoned');
ROLLBACK;
-- rolled back: abandoned still, for the next completer
SELECT key, attempt FROM idempotency.idem_claim_abandoned('abandoned', 10);

--
-- counted as takeovers of abandoned keys
--
SELECT coalesce(sum(abandoned_takeovers), 0) - :counted_before AS abandoned_takeovers
  FROM idempotency.stats;

--
-- bad input: an error with its SQLSTATE, and nothing changed
--
SELECT * FROM idempotency.idem_claim_abandoned(NULL);
SELECT * FROM idempotency.idem_claim_abandoned('abandoned', NULL);
SELECT * FROM idempotency.idem_claim_abandoned('abandoned', 0);
SELECT * FROM idempotency.idem_claim_abandoned('abandoned', 10001);
SELECT * FROM idempotency.idem_claim_abandoned('abandoned', 1, '0 seconds');
SELECT * FROM idempotency.idem_claim_abandoned('abandoned', 1, '-1 second');
SELECT * FROM idempotency.idem_claim_abandoned(repeat('s', 256));
SET idempotency.max_response_size = 16;
SELECT * FROM idempotency.idem_claim('big', '{"amount": 100000000000}', 'abandoned',
	keep_request => true);
SELECT count(*) AS stored FROM idempotency.keys WHERE scope = 'abandoned' AND key = 'big';
-- without keep_request the request is only fingerprinted
SELECT outcome FROM idempotency.idem_claim('big', '{"amount": 100000000000}', 'abandoned');
RESET idempotency.max_response_size;
BEGIN READ ONLY;
SELECT * FROM idempotency.idem_claim_abandoned('abandoned');
ROLLBACK;

--
-- PUBLIC may call it (as idem_claim); a role bound to a scope prefix only
-- within it
--
SELECT has_function_privilege('public',
	'idempotency.idem_claim_abandoned(text, integer, interval)', 'EXECUTE') AS public_may;
CREATE ROLE regress_abandoned_tenant;
GRANT USAGE ON SCHEMA idempotency TO regress_abandoned_tenant;
SELECT idempotency.bind_scope('regress_abandoned_tenant', 'tenant-a:');
SET ROLE regress_abandoned_tenant;
SELECT count(*) AS taken FROM idempotency.idem_claim_abandoned('tenant-a:jobs', 10);
SELECT * FROM idempotency.idem_claim_abandoned('abandoned', 10);
RESET ROLE;
SELECT idempotency.unbind_scope('regress_abandoned_tenant');
REVOKE USAGE ON SCHEMA idempotency FROM regress_abandoned_tenant;
DROP ROLE regress_abandoned_tenant;

DELETE FROM idempotency.keys WHERE scope = 'abandoned';
