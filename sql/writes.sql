--
-- writes.sql: the claim's insert and the updates of claim, finish and
-- extend write the same rows whether they go straight to the table AM (the
-- table as the extension made it) or through the prepared SQL statements
-- (a user attached a trigger, a rule or row security, which must still
-- fire); a user's CHECK constraint and extra index are honoured on the
-- direct path too; a column default a user added never leaks into a claim.
--
\set VERBOSITY sqlstate

-- The first claim of key c in "p_scope", with a lease of 1 ms: made and
-- committed before pg_temp.script takes it over.
CREATE FUNCTION pg_temp.stale_claim(p_scope text) RETURNS text
LANGUAGE sql AS $$
	SELECT outcome FROM idempotency.idem_claim('c', '{"n": 3}', p_scope, lease => '1 millisecond')
$$;

-- One scripted life of three keys in "p_scope": a fresh claim with a
-- request, a claim without one, a takeover after the lease ended, an
-- extend, finishes with and without a body, then the stored rows with
-- every timestamp as whole minutes from now (the transaction's start).
CREATE FUNCTION pg_temp.minutes(t timestamptz) RETURNS numeric
LANGUAGE sql AS $$ SELECT round(extract(epoch FROM t - now()) / 60) $$;
CREATE FUNCTION pg_temp.script(p_scope text)
RETURNS TABLE (key text, status text, token_rank bigint, attempt int,
               has_fingerprint boolean, response_code int, response_body jsonb,
               finished boolean, lease_min numeric, expires_min numeric,
               sweep_min numeric)
LANGUAGE plpgsql AS $$
DECLARE
	t_a bigint; t_b bigint; t_c2 bigint;
BEGIN
	SELECT c.token INTO t_a FROM idempotency.idem_claim('a', '{"n": 1}', p_scope) c;
	SELECT c.token INTO t_b FROM idempotency.idem_claim('b', NULL, p_scope, lease => '1 hour') c;
	-- c's first claim (pg_temp.stale_claim) committed before, in a
	-- transaction of its own: a transaction never takes over its own claim
	PERFORM pg_sleep_until(k.lease_until) FROM idempotency.keys k
	  WHERE k.scope = p_scope AND k.key = 'c';
	SELECT c.token INTO t_c2 FROM idempotency.idem_claim('c', '{"n": 3}', p_scope, lease => '10 minutes') c;
	PERFORM idempotency.idem_extend('b', t_b, '2 hours', p_scope);
	PERFORM idempotency.idem_finish('a', t_a, 201, '{"id": 1}', p_scope);
	PERFORM idempotency.idem_finish('c', t_c2, 500, NULL, p_scope, 'failed', '1 hour');
	RETURN QUERY
	SELECT k.key, k.status, rank() OVER (ORDER BY k.token), k.attempt,
	       k.fingerprint IS NOT NULL, k.response_code, k.response_body,
	       k.finished_at IS NOT NULL, pg_temp.minutes(k.lease_until),
	       pg_temp.minutes(k.expires_at), pg_temp.minutes(k.sweep_at)
	  FROM idempotency.keys k WHERE k.scope = p_scope ORDER BY k.key;
END $$;

-- the table as the extension made it: direct writes
SELECT pg_temp.stale_claim('w-direct');
SELECT * FROM pg_temp.script('w-direct');

-- with a row trigger: statements, and the trigger sees every write
CREATE TABLE write_log (op text, key text, status text, attempt int);
-- the table's triggers and rules write here with its owner's rights
DO $$ BEGIN EXECUTE format('GRANT SELECT, INSERT ON write_log TO %s', (SELECT c.relowner::regrole FROM pg_class c
    WHERE c.oid = 'idempotency.keys'::regclass)); END $$;
CREATE FUNCTION write_log_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.write_log VALUES (TG_OP, NEW.key, NEW.status, NEW.attempt); RETURN NEW; END $$;
SELECT pg_temp.stale_claim('w-trigger');
BEGIN;
CREATE TRIGGER keys_write_log AFTER INSERT OR UPDATE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION write_log_row();
SELECT * FROM pg_temp.script('w-trigger');
SELECT op, key, status, attempt, count(*) FROM write_log GROUP BY 1, 2, 3, 4 ORDER BY 2, 1, 4, 3;
ROLLBACK;

-- with a rule: statements, and the rule fires
SELECT pg_temp.stale_claim('w-rule');
BEGIN;
CREATE RULE keys_write_log AS ON UPDATE TO idempotency.keys
	DO ALSO INSERT INTO write_log VALUES ('rule', NEW.key, NEW.status, NEW.attempt);
SELECT * FROM pg_temp.script('w-rule');
SELECT op, key, status, attempt FROM write_log ORDER BY 2, 4, 3;
ROLLBACK;

-- with row security enabled (the owner is exempt): statements
SELECT pg_temp.stale_claim('w-rls');
BEGIN;
ALTER TABLE idempotency.keys ENABLE ROW LEVEL SECURITY;
SELECT * FROM pg_temp.script('w-rls');
ROLLBACK;

-- a user's CHECK constraint holds on the direct path: 23514, nothing stored
BEGIN;
ALTER TABLE idempotency.keys ADD CONSTRAINT keys_short_key CHECK (length(key) < 5);
SELECT outcome FROM idempotency.idem_claim('long-key', scope => 'w-check');
ROLLBACK;
BEGIN;
ALTER TABLE idempotency.keys ADD CONSTRAINT keys_code CHECK (response_code < 600);
SELECT outcome, token AS t FROM idempotency.idem_claim('k', scope => 'w-check') \gset
SELECT idempotency.idem_finish('k', :t, 700, NULL, 'w-check');
ROLLBACK;
SELECT count(*) AS stored FROM idempotency.keys WHERE scope = 'w-check';

-- a user's index gets every row the direct path writes, the new version of
-- a non-HOT update too
SELECT pg_temp.stale_claim('w-index');
BEGIN;
CREATE INDEX keys_user_attempt_idx ON idempotency.keys (scope, attempt);
SELECT key, status, attempt FROM pg_temp.script('w-index') ORDER BY key;
SET LOCAL enable_seqscan = off;
SET LOCAL enable_bitmapscan = off;
EXPLAIN (COSTS OFF) SELECT key FROM idempotency.keys WHERE scope = 'w-index' AND attempt = 2;
SELECT key, attempt FROM idempotency.keys WHERE scope = 'w-index' AND attempt = 2;
SELECT count(*) AS attempt_1 FROM idempotency.keys WHERE scope = 'w-index' AND attempt = 1;
ROLLBACK;

-- a default a user put on a column does not leak into a claim, on either path
BEGIN;
ALTER TABLE idempotency.keys ALTER COLUMN response_code SET DEFAULT 299;
SELECT outcome FROM idempotency.idem_claim('d1', scope => 'w-default');
CREATE TRIGGER keys_write_log AFTER INSERT OR UPDATE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION write_log_row();
SELECT outcome FROM idempotency.idem_claim('d2', scope => 'w-default');
SELECT key, response_code FROM idempotency.keys WHERE scope = 'w-default' ORDER BY key;
ROLLBACK;

-- in one transaction a key claimed by a direct insert is seen by the next
-- call of the same statement (in_progress, held by us), and by the finish
BEGIN;
SELECT g, c.outcome, c.retry_after FROM generate_series(1, 2) g,
       LATERAL idempotency.idem_claim(CASE WHEN g > 0 THEN 'same' END,
                                      scope => 'w-xact') c ORDER BY g;
SELECT idempotency.idem_finish('same', token, 200, NULL, 'w-xact') IS NOT NULL AS finished
  FROM idempotency.keys WHERE scope = 'w-xact';
SELECT outcome, status, response_code FROM idempotency.idem_claim('same', scope => 'w-xact');
ROLLBACK;

-- the first claims of c that committed before their scripts
DELETE FROM idempotency.keys WHERE scope IN ('w-trigger', 'w-rule', 'w-rls', 'w-index');

-- a row written earlier in the same statement: idem_sweep resets a stale
-- claim and the claim that follows it in the same SELECT takes it over.
-- The claim commits with a 300 ms lease, then the row is locked FOR UPDATE
-- before the lease ends, so the worker cannot reset it instead (our own
-- sweep still does).
SELECT outcome, attempt FROM idempotency.idem_claim('stale', scope => 'w-cci',
       lease => '300 milliseconds');
BEGIN;
SELECT key, lease_until > clock_timestamp() AS lease_live
  FROM idempotency.keys WHERE scope = 'w-cci' FOR UPDATE;
SELECT pg_sleep(0.4);
SELECT s.reset AS swept_reset, c.outcome, c.attempt
  FROM idempotency.idem_sweep() s,
       LATERAL idempotency.idem_claim(CASE WHEN s.reset >= 0 THEN 'stale' END,
                                      scope => 'w-cci') c;
SELECT status, attempt, token IS NOT NULL AS has_token FROM idempotency.keys WHERE scope = 'w-cci';
ROLLBACK;
DELETE FROM idempotency.keys WHERE scope = 'w-cci';

-- in a publication that publishes updates, the table needs its replica
-- identity for a finish (55000), as for any UPDATE; a claim's insert does not
BEGIN;
ALTER TABLE idempotency.keys REPLICA IDENTITY NOTHING;
SET LOCAL client_min_messages = error;
CREATE PUBLICATION idem_writes_pub FOR TABLE idempotency.keys;
SELECT outcome, token AS t FROM idempotency.idem_claim('pub', scope => 'w-pub') \gset
SELECT :'outcome' AS outcome;
SELECT idempotency.idem_finish('pub', :t, 200, NULL, 'w-pub');
ROLLBACK;

-- A trigger on the table that calls the functions again opens a store
-- section inside another one (the claim's insert, the finish's update and
-- the sweep's delete fire it while acting as the table's owner).  Each
-- section restores what its own caller had: after every call the caller is
-- itself again, not the table owner, and may do what a restricted-security
-- section may not (RESET ROLE).  A trigger that changes a setting inside
-- the write (here enable_seqscan, which the write itself turns off while
-- it runs) leaves the session's value as it was after the commit.
CREATE ROLE regress_idem_nested;
GRANT USAGE ON SCHEMA idempotency TO regress_idem_nested;
GRANT EXECUTE ON FUNCTION idempotency.idem_sweep(integer) TO regress_idem_nested;
CREATE FUNCTION claim_audit_key() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	PERFORM set_config('enable_seqscan', 'on', true);
	IF TG_OP = 'DELETE' THEN
		IF OLD.scope = 'w-nested-sweep' THEN
			PERFORM idempotency.idem_claim('gone-' || OLD.key, NULL, 'w-nested-audit');
		END IF;
		RETURN OLD;
	ELSIF NEW.scope = 'w-nested' THEN
		PERFORM idempotency.idem_claim(lower(TG_OP) || '-' || NEW.key || '-' || NEW.status,
		                               NULL, 'w-nested-audit');
	END IF;
	RETURN NEW;
END $$;
CREATE TRIGGER keys_claim_audit AFTER INSERT OR UPDATE OR DELETE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION claim_audit_key();
SET ROLE regress_idem_nested;
SELECT outcome, attempt FROM idempotency.idem_claim('n1', NULL, 'w-nested');
SELECT current_user AS after_claim, current_setting('enable_seqscan') AS enable_seqscan;
SELECT outcome, token AS t FROM idempotency.idem_claim('n2', NULL, 'w-nested') \gset
SELECT idempotency.idem_finish('n2', :t, 200, NULL, 'w-nested') IS NOT NULL AS finished;
SELECT current_user AS after_finish, current_setting('enable_seqscan') AS enable_seqscan;
SELECT outcome FROM idempotency.idem_claim('n3', NULL, 'w-nested-sweep',
       lease => '1 millisecond', retention => '1 millisecond');
SELECT pg_sleep(0.01);
SELECT expired >= 1 AS swept FROM idempotency.idem_sweep();
SELECT current_user AS after_sweep, current_setting('enable_seqscan') AS enable_seqscan;
RESET ROLE;
SELECT scope, key, status, attempt FROM idempotency.keys
 WHERE scope LIKE 'w-nested%' ORDER BY scope, key;
DROP TRIGGER keys_claim_audit ON idempotency.keys;
DROP FUNCTION claim_audit_key();
DELETE FROM idempotency.keys WHERE scope LIKE 'w-nested%';
REVOKE ALL ON FUNCTION idempotency.idem_sweep(integer) FROM regress_idem_nested;
REVOKE ALL ON SCHEMA idempotency FROM regress_idem_nested;
DROP ROLE regress_idem_nested;

DROP TABLE write_log;
DROP FUNCTION write_log_row();
