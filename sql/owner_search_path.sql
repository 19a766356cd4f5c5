--
-- owner_search_path.sql: what the extension runs with the table owner's
-- rights (its writes, and so a trigger a DBA put on idempotency.keys)
-- runs with search_path = pg_catalog, pg_temp.  A caller with nothing but
-- EXECUTE on the functions cannot get an unqualified name in such a
-- trigger resolved in a schema of its own: here a planted now() that
-- would make the caller superuser is never called.  A trigger that
-- schema-qualifies what it uses works; one that
-- names its table unqualified fails (42P01) whatever the caller's
-- search_path, and nothing is stored.
--
\set VERBOSITY sqlstate

CREATE ROLE regress_idem_mallory LOGIN;
GRANT USAGE ON SCHEMA idempotency TO regress_idem_mallory;
CREATE SCHEMA regress_idem_mallory AUTHORIZATION regress_idem_mallory;

-- the DBA's audit trigger: unqualified now(), qualified table
CREATE TABLE public.keys_audit (at timestamptz, key text, who text);
-- the table's triggers and rules write here with its owner's rights
DO $$ BEGIN EXECUTE format('GRANT SELECT, INSERT ON public.keys_audit TO %s', (SELECT c.relowner::regrole FROM pg_class c
    WHERE c.oid = 'idempotency.keys'::regclass)); END $$;
CREATE FUNCTION public.keys_audit_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO public.keys_audit VALUES (now(), NEW.key, current_user);
	RETURN NEW;
END $$;
CREATE TRIGGER keys_audit AFTER INSERT OR UPDATE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION public.keys_audit_row();

-- the caller plants now() in its own schema and puts it first
SET ROLE regress_idem_mallory;
CREATE FUNCTION regress_idem_mallory.now() RETURNS timestamptz
LANGUAGE plpgsql AS $$
BEGIN
	ALTER ROLE regress_idem_mallory SUPERUSER;
	RETURN pg_catalog.now();
END $$;
SET search_path = regress_idem_mallory, pg_catalog;
SELECT outcome FROM idempotency.idem_claim('m1', scope => 'owner-path');
SELECT idempotency.idem_finish('m2', token, 200, NULL, 'owner-path') IS NOT NULL AS finished
  FROM idempotency.idem_claim('m2', scope => 'owner-path');
RESET search_path;
RESET ROLE;

-- the planted function never ran; the trigger ran, as the table's owner
SELECT rolsuper FROM pg_roles WHERE rolname = 'regress_idem_mallory';
SELECT key, who = (SELECT r.rolname FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
                    WHERE c.oid = 'idempotency.keys'::regclass) AS as_owner
  FROM public.keys_audit ORDER BY key, at;

-- the sweep (and the worker's) runs likewise: m1's lease is made to end
-- (without the trigger), then a sweep under the planted search_path
-- resets it, and the trigger sees the reset
ALTER TABLE idempotency.keys DISABLE TRIGGER keys_audit;
UPDATE idempotency.keys SET lease_until = now() - interval '1 second',
       sweep_at = now() - interval '1 second' WHERE scope = 'owner-path' AND key = 'm1';
ALTER TABLE idempotency.keys ENABLE TRIGGER keys_audit;
SET search_path = regress_idem_mallory, pg_catalog;
SELECT reset FROM idempotency.idem_sweep();
RESET search_path;
SELECT rolsuper FROM pg_roles WHERE rolname = 'regress_idem_mallory';
SELECT count(*) AS audited FROM public.keys_audit WHERE key = 'm1';

-- a trigger naming its table unqualified fails (42P01), whatever the
-- caller's search_path says, and the claim is not stored
DROP TRIGGER keys_audit ON idempotency.keys;
CREATE FUNCTION public.keys_audit_unqualified() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO keys_audit VALUES (pg_catalog.now(), NEW.key, current_user);
	RETURN NEW;
END $$;
CREATE TRIGGER keys_audit AFTER INSERT OR UPDATE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION public.keys_audit_unqualified();
SET search_path = public;
SELECT outcome FROM idempotency.idem_claim('m3', scope => 'owner-path');
RESET search_path;
SELECT count(*) AS stored FROM idempotency.keys WHERE scope = 'owner-path' AND key = 'm3';

DROP TRIGGER keys_audit ON idempotency.keys;
DROP FUNCTION public.keys_audit_row(), public.keys_audit_unqualified();
DROP TABLE public.keys_audit;
DELETE FROM idempotency.keys WHERE scope = 'owner-path';
DROP SCHEMA regress_idem_mallory CASCADE;
REVOKE USAGE ON SCHEMA idempotency FROM regress_idem_mallory;
DROP ROLE regress_idem_mallory;
