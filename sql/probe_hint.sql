--
-- probe_hint.sql: a token call right after this connection wrote the key
-- reads the row version it wrote instead of descending the primary key,
-- and falls back to the index whenever that version may not be the key's
-- newest one: another key was written since, the table was rewritten,
-- the version was deleted.  (Where a VACUUM changed what the remembered
-- place holds: t/121_probe_hint_vacuum.pl.)  The primary key's scans are
-- counted with pg_stat_get_xact_numscans.
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE tok (key text PRIMARY KEY, token bigint);
-- the primary key's scans so far (reported when the session goes idle,
-- so read before and after a call in one transaction)
CREATE FUNCTION pg_temp.pkey_scans() RETURNS bigint LANGUAGE sql AS $$
	SELECT pg_stat_get_xact_numscans('idempotency.keys_pkey'::regclass) $$;
-- claim key k, keeping its token: the outcome and the scans it made
CREATE FUNCTION pg_temp.claim(k text, OUT outcome text, OUT attempt int,
	OUT pkey_scans bigint) LANGUAGE plpgsql AS $$
DECLARE
	s0 bigint := pg_temp.pkey_scans();
	c record;
BEGIN
	SELECT * INTO c FROM idempotency.idem_claim(k, scope => 'probe_hint');
	IF c.outcome = 'claimed' THEN
		INSERT INTO tok VALUES (k, c.token)
		ON CONFLICT (key) DO UPDATE SET token = excluded.token;
	END IF;
	outcome := c.outcome;
	attempt := c.attempt;
	pkey_scans := pg_temp.pkey_scans() - s0;
END $$;
-- finish key k with its token: whether it stored, and the scans it made
CREATE FUNCTION pg_temp.finish(k text, code int, OUT finished boolean,
	OUT pkey_scans bigint) LANGUAGE plpgsql AS $$
DECLARE
	s0 bigint := pg_temp.pkey_scans();
BEGIN
	finished := idempotency.idem_finish(k,
		(SELECT token FROM tok WHERE key = k), code, '{"ok": true}',
		scope => 'probe_hint') IS NOT NULL;
	pkey_scans := pg_temp.pkey_scans() - s0;
END $$;

-- A claim of a new key scans the primary key once; its finish on the same
-- connection reads the version the claim wrote, in one transaction or
-- the next.
BEGIN;
SELECT * FROM pg_temp.claim('a');
SELECT * FROM pg_temp.finish('a', 200);
COMMIT;
SELECT * FROM pg_temp.claim('a2');
SELECT * FROM pg_temp.finish('a2', 200);
SELECT key, status, response_code, response_body, attempt,
	   token = (SELECT token FROM tok t WHERE t.key = k.key) AS same_token
  FROM idempotency.keys k WHERE scope = 'probe_hint' ORDER BY key;

-- The hint names one key: after a write of another key, a finish of the
-- first one scans the primary key.
SELECT * FROM pg_temp.claim('b');
SELECT * FROM pg_temp.claim('c');
SELECT * FROM pg_temp.finish('b', 201);

-- A replay on the connection that finished the key reads the finished
-- version (an update's version is hinted as an insert's is).
SELECT * FROM pg_temp.claim('b');

-- A finish after the table was rewritten (VACUUM FULL gives it a new
-- file): the index answers, and the finish stores its result.
SELECT * FROM pg_temp.claim('c2');
VACUUM FULL idempotency.keys;
SELECT * FROM pg_temp.finish('c2', 202);
SELECT key, status, response_code FROM idempotency.keys
 WHERE scope = 'probe_hint' ORDER BY key;

-- A released key: the hinted version is deleted, so the next claim of the
-- key finds it absent and claims it afresh.
INSERT INTO tok SELECT 'd', token
  FROM idempotency.idem_claim('d', scope => 'probe_hint');
SELECT idempotency.idem_release('d', (SELECT token FROM tok WHERE key = 'd'),
	'probe_hint')::text = '' AS released;
SELECT outcome, attempt, token > (SELECT token FROM tok WHERE key = 'd') AS newer
  FROM idempotency.idem_claim('d', scope => 'probe_hint');

DELETE FROM idempotency.keys WHERE scope = 'probe_hint';
