--
-- tenant_cache.sql: a scope binding committed while a tenant's session is
-- inside a REPEATABLE READ transaction applies to that session at the
-- latest once the transaction has ended: the session's cache of bindings
-- must not be reloaded from an old snapshot and then kept.
--
-- The tenant's session runs over dblink (skipped where dblink is not
-- available: tenant_cache_1.out).
--
SELECT count(*) = 0 AS skip_test FROM pg_available_extensions WHERE name = 'dblink' \gset
\if :skip_test
\quit
\endif
\set VERBOSITY sqlstate
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS dblink;
RESET client_min_messages;
CREATE ROLE regress_tenant_late;
GRANT USAGE ON SCHEMA idempotency TO regress_tenant_late;
-- claim, as the calling role; the outcome or the error's SQLSTATE
CREATE FUNCTION public.regress_try_claim(k text, s text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog AS $$
DECLARE
	o text;
BEGIN
	SELECT c.outcome INTO o FROM idempotency.idem_claim(k, NULL, s) c;
	RETURN o;
EXCEPTION WHEN OTHERS THEN
	RETURN 'ERROR ' || SQLSTATE;
END $$;

SELECT dblink_connect('tenant',
       format('host=%s port=%s dbname=%s user=%s',
              coalesce(nullif(split_part(current_setting('unix_socket_directories'), ',', 1), ''),
                       'localhost'),
              current_setting('port'), current_database(), current_user)) AS connected;
SELECT dblink_exec('tenant', 'SET ROLE regress_tenant_late') AS set_role;
-- the tenant works unbound, so its session has read the (empty) bindings
SELECT * FROM dblink('tenant', $$SELECT public.regress_try_claim('k0', 'late:1')$$) AS t(result text);
-- it opens a REPEATABLE READ transaction and takes its snapshot
SELECT dblink_exec('tenant', 'BEGIN ISOLATION LEVEL REPEATABLE READ') AS began;
SELECT * FROM dblink('tenant', 'SELECT 1') AS t(snapshot int);

-- meanwhile the DBA binds it
SELECT idempotency.bind_scope('regress_tenant_late', 'late:') AS bound;

-- the tenant's transaction goes on (its first lock takes in the
-- invalidation; what a call inside that old snapshot answers is left open)
-- and ends
SELECT * FROM dblink('tenant', $$SELECT count(*) > 0 FROM pg_catalog.pg_am$$) AS t(touched bool);
SELECT result IN ('claimed', 'ERROR 42501') AS either
  FROM dblink('tenant', $$SELECT public.regress_try_claim('k1', 'elsewhere')$$) AS t(result text);
SELECT dblink_exec('tenant', 'ROLLBACK') AS ended;

-- from now on the binding holds in that session, as in any other
SELECT * FROM dblink('tenant', $$SELECT public.regress_try_claim('k2', 'elsewhere')$$) AS t(result text);
SELECT * FROM dblink('tenant', $$SELECT public.regress_try_claim('k3', 'late:2')$$) AS t(result text);
SET ROLE regress_tenant_late;
SELECT public.regress_try_claim('k4', 'elsewhere') AS result_in_a_new_session_state;
RESET ROLE;
SELECT count(*) AS keys_elsewhere FROM idempotency.keys WHERE scope = 'elsewhere';

SELECT dblink_disconnect('tenant') AS disconnected;
SELECT idempotency.unbind_scope('regress_tenant_late') AS was_bound;
DROP FUNCTION public.regress_try_claim(text, text);
DELETE FROM idempotency.keys WHERE scope IN ('late:1', 'late:2', 'elsewhere');
REVOKE USAGE ON SCHEMA idempotency FROM regress_tenant_late;
DROP ROLE regress_tenant_late;
