--
-- owner_temp_objects.sql: a caller's temporary objects are never reachable
-- from the writes the extension makes with the table owner's rights.
-- PostgreSQL looks unqualified table and type names up in the session's
-- temporary schema whatever search_path says, so a caller's temporary
-- table named like an unqualified table in a DBA's trigger would receive
-- the trigger's write, and the caller's own trigger on it would run as the
-- owner.  A write that can run code a user attached to idempotency.keys is
-- refused (55000) while the session has temporary tables or types; nothing
-- is stored, and the caller gains nothing.  Temporary functions (never
-- looked up by an unqualified name) do not count, and without such code
-- on the table temporary tables change nothing.
--
\set SHOW_CONTEXT errors
\set VERBOSITY sqlstate

CREATE ROLE regress_idem_trudy LOGIN;
GRANT USAGE ON SCHEMA idempotency TO regress_idem_trudy;

-- the DBA's audit trigger names its table unqualified (a bug, but one the
-- caller must not be able to use)
CREATE TABLE public.keys_audit (key text, who text);
-- the table's triggers write here with its owner's rights
DO $$ BEGIN EXECUTE format('GRANT SELECT, INSERT ON public.keys_audit TO %s', (SELECT c.relowner::regrole FROM pg_class c
    WHERE c.oid = 'idempotency.keys'::regclass)); END $$;
CREATE FUNCTION public.keys_audit_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO keys_audit VALUES (NEW.key, current_user);
	RETURN NEW;
END $$;
CREATE TRIGGER keys_audit AFTER INSERT OR UPDATE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION public.keys_audit_row();

-- the caller's temporary table of that name, with a trigger that would
-- make the caller superuser if it ran as the table's owner
SET ROLE regress_idem_trudy;
CREATE TEMP TABLE keys_audit (key text, who text);
CREATE FUNCTION pg_temp.escalate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	ALTER ROLE regress_idem_trudy SUPERUSER;
	RETURN NEW;
END $$;
CREATE TRIGGER escalate BEFORE INSERT ON pg_temp.keys_audit
	FOR EACH ROW EXECUTE FUNCTION pg_temp.escalate();
SELECT outcome FROM idempotency.idem_claim('t1', scope => 'owner-temp');
\set VERBOSITY default
\set SHOW_CONTEXT never
SELECT outcome FROM idempotency.idem_claim('t1', scope => 'owner-temp');
\set SHOW_CONTEXT errors
\set VERBOSITY sqlstate
-- a batch and the sweep are refused alike
SELECT count(*) FROM idempotency.idem_claim_many(ARRAY['t2', 't3'], scope => 'owner-temp');
RESET ROLE;
SELECT reset FROM idempotency.idem_sweep();
SET ROLE regress_idem_trudy;
-- nothing reached the temporary table, nothing is stored, no new superuser
SELECT count(*) AS in_temp_table FROM pg_temp.keys_audit;
RESET ROLE;
SELECT rolsuper FROM pg_roles WHERE rolname = 'regress_idem_trudy';
SELECT count(*) AS stored FROM idempotency.keys WHERE scope = 'owner-temp';
SELECT count(*) AS audited FROM public.keys_audit;

-- a temporary type counts as a table does
SET ROLE regress_idem_trudy;
DROP TABLE pg_temp.keys_audit;
CREATE TYPE pg_temp.audit_kind AS ENUM ('a');
SELECT outcome FROM idempotency.idem_claim('t4', scope => 'owner-temp');
DROP TYPE pg_temp.audit_kind;

-- with only a temporary function left, the write runs: the trigger's
-- unqualified table resolves nowhere the caller controls (42P01), and
-- the claim is not stored
SELECT outcome FROM idempotency.idem_claim('t5', scope => 'owner-temp');
RESET ROLE;
SELECT count(*) AS stored FROM idempotency.keys WHERE scope = 'owner-temp';

-- a trigger that qualifies its table works for a caller without
-- temporary tables, as the owner
CREATE OR REPLACE FUNCTION public.keys_audit_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO public.keys_audit VALUES (NEW.key, current_user);
	RETURN NEW;
END $$;
SET ROLE regress_idem_trudy;
SELECT outcome FROM idempotency.idem_claim('t6', scope => 'owner-temp');
RESET ROLE;
SELECT key, who = (SELECT r.rolname FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
                    WHERE c.oid = 'idempotency.keys'::regclass) AS as_owner
  FROM public.keys_audit ORDER BY key;

-- without code a user attached to the table, temporary tables change
-- nothing: the writes go straight to the table
DROP TRIGGER keys_audit ON idempotency.keys;
SET ROLE regress_idem_trudy;
CREATE TEMP TABLE keys_audit (key text, who text);
SELECT outcome, token AS t7_token
  FROM idempotency.idem_claim('t7', scope => 'owner-temp') \gset
SELECT :'outcome' AS outcome;
SELECT idempotency.idem_finish('t7', :t7_token, 200, '{"ok": true}', 'owner-temp') IS NOT NULL AS finished;
RESET ROLE;
SELECT key, status, attempt, response_body, token = :t7_token AS t7_token
  FROM idempotency.keys WHERE scope = 'owner-temp' ORDER BY key;

-- a CHECK constraint or an index expression is code a user attached too,
-- whatever it calls (a domain's CHECK, a cast or one of PostgreSQL's
-- functions can reach a user's code without naming it)
CREATE FUNCTION public.audit_ok(text) RETURNS boolean LANGUAGE plpgsql IMMUTABLE
	AS $$ BEGIN RETURN $1 IS NOT NULL; END $$;
BEGIN;
ALTER TABLE idempotency.keys ADD CONSTRAINT keys_audit_ok CHECK (public.audit_ok(status));
SET ROLE regress_idem_trudy;
SELECT outcome FROM idempotency.idem_claim('t8', scope => 'owner-temp');
ROLLBACK;
BEGIN;
CREATE INDEX keys_audit_idx ON idempotency.keys (public.audit_ok(key));
SET ROLE regress_idem_trudy;
SELECT outcome FROM idempotency.idem_claim('t8', scope => 'owner-temp');
ROLLBACK;
BEGIN;
ALTER TABLE idempotency.keys ADD CONSTRAINT keys_code_ok CHECK (response_code BETWEEN 100 AND 599);
SET ROLE regress_idem_trudy;
SELECT outcome FROM idempotency.idem_claim('t8', scope => 'owner-temp');
ROLLBACK;
-- without temporary tables (the session's, whichever role made them),
-- the same writes run
SET ROLE regress_idem_trudy;
DISCARD TEMP;
RESET ROLE;
BEGIN;
ALTER TABLE idempotency.keys ADD CONSTRAINT keys_code_ok CHECK (response_code BETWEEN 100 AND 599);
SELECT outcome FROM idempotency.idem_claim('t8', scope => 'owner-temp');
ROLLBACK;

-- an index calling a LANGUAGE sql function that PostgreSQL inlines is
-- refused for every session (55000): its body's names are resolved with
-- the search_path of whichever session plans the table first, and the
-- owner's writes would run what they resolved to; with a search_path of
-- its own it is not inlined, and counts as any index expression does
CREATE FUNCTION public.norm(text) RETURNS text LANGUAGE sql IMMUTABLE
	AS $$ SELECT lower($1) $$;
BEGIN;
CREATE INDEX keys_norm_idx ON idempotency.keys (public.norm(key));
SAVEPOINT s;
SELECT outcome FROM idempotency.idem_claim('t9', scope => 'owner-temp');
ROLLBACK TO s;
\set VERBOSITY default
\set SHOW_CONTEXT never
SELECT status FROM idempotency.idem_lookup('t9', scope => 'owner-temp');
ROLLBACK TO s;
\set SHOW_CONTEXT errors
\set VERBOSITY sqlstate
ALTER FUNCTION public.norm(text) SET search_path = pg_catalog;
SELECT outcome FROM idempotency.idem_claim('t9', scope => 'owner-temp');
ROLLBACK;
DROP FUNCTION public.norm(text);

-- a deferrable trigger would fire at commit, outside the write: refused
CREATE FUNCTION public.keys_noop() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RETURN NULL; END $$;
BEGIN;
CREATE CONSTRAINT TRIGGER keys_noop AFTER INSERT ON idempotency.keys
	DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.keys_noop();
SELECT outcome FROM idempotency.idem_claim('t10', scope => 'owner-temp');
ROLLBACK;
BEGIN;
CREATE CONSTRAINT TRIGGER keys_noop AFTER INSERT ON idempotency.keys
	NOT DEFERRABLE FOR EACH ROW EXECUTE FUNCTION public.keys_noop();
SELECT outcome FROM idempotency.idem_claim('t10', scope => 'owner-temp');
ROLLBACK;
DROP FUNCTION public.keys_noop();
SELECT count(*) AS stored FROM idempotency.keys WHERE scope = 'owner-temp' AND key IN ('t8', 't9', 't10');

SET ROLE regress_idem_trudy;
DISCARD TEMP;
RESET ROLE;
DROP FUNCTION public.keys_audit_row(), public.audit_ok(text);
DROP TABLE public.keys_audit;
DELETE FROM idempotency.keys WHERE scope = 'owner-temp';
REVOKE USAGE ON SCHEMA idempotency FROM regress_idem_trudy;
DROP ROLE regress_idem_trudy;
