-- test/fuzz/setup.sql: the database that scripts/fuzz.sh fuzzes, run as a
-- superuser in a fresh database of a throwaway cluster.
--
-- Roles:
--   fuzz_app     the property test's role: EXECUTE on every function of the
--                extension (idem_sweep, idem_forget, stats_reset, bind_scope
--                and unbind_scope included), never bound to a scope prefix
--   fuzz_tenant  a tenant's role, bound to the prefix 'tenant:'; the
--                property test connects as it too, so 42501 has a caller;
--                EXECUTE on idem_forget, so that its calls reach the
--                tenant binding
--   fuzz_plain   an application's role with only what PUBLIC has: the
--                property test calls idem_forget as it, so that a missing
--                grant has a caller
--   fuzz_smith   SQLsmith's role: the same grants as fuzz_app, and the
--                tables of schema fuzz_data to read and write
-- None is a superuser, none is a member of pg_signal_backend, and EXECUTE
-- on pg_terminate_backend and pg_cancel_backend is revoked in this
-- database, so that SQLsmith cannot end its own session or the property
-- test's: a connection that ends is then always the server's doing.
--
-- Keys in every state, in scope 'seed' (SQLsmith finds them, with their
-- tokens, in fuzz_data.known_keys): pending with a live lease, pending with
-- an ended lease, pending and checkpointed, succeeded, failed, released (a
-- dead token, no row), session-bound to a session that has ended, past its
-- retention, remembered (finished with remember, then its times moved back
-- past its retention: compacted by a sweep, or not yet), past its remember
-- too, and a pending key in the tenant's scope.
--
-- SQLsmith calls only functions that return one value per call, so the
-- set-returning ones (idem_claim, idem_claim_many, idem_finish_many,
-- idem_lookup, idem_sweep) are reachable to it through the SQL wrappers in
-- fuzz_data, which return their rows as text.  They are SECURITY INVOKER:
-- every call runs as the role that makes it.
\set ON_ERROR_STOP 1
SET client_min_messages = warning;

CREATE ROLE fuzz_app LOGIN;
CREATE ROLE fuzz_tenant LOGIN;
CREATE ROLE fuzz_smith LOGIN;
CREATE ROLE fuzz_plain LOGIN;
CREATE ROLE fuzz_nobody NOLOGIN;
GRANT USAGE ON SCHEMA idempotency TO fuzz_app, fuzz_tenant, fuzz_smith, fuzz_plain;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA idempotency TO fuzz_app, fuzz_smith;
GRANT EXECUTE ON FUNCTION idempotency.idem_forget(text, text) TO fuzz_tenant;
SELECT idempotency.bind_scope('fuzz_tenant', 'tenant:');
-- bind_scope and unbind_scope run as their caller, and so write the
-- bindings with fuzz_app's own rights
GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency.scope_bindings TO fuzz_app;
REVOKE EXECUTE ON FUNCTION pg_catalog.pg_terminate_backend(integer, bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION pg_catalog.pg_cancel_backend(integer) FROM PUBLIC;

CREATE SCHEMA fuzz_data;
GRANT USAGE ON SCHEMA fuzz_data TO fuzz_smith;

CREATE TABLE fuzz_data.known_keys (
	state	text,
	scope	text,
	key		text,
	token	bigint,
	request	jsonb,
	lease	interval,
	phase	text,
	keys	text[],
	tokens	bigint[]
);
GRANT SELECT, INSERT, UPDATE, DELETE ON fuzz_data.known_keys TO fuzz_smith;

-- One key in <state>: claimed with <lease>, then <then> applied to it
-- ('finish', 'fail', 'release', 'checkpoint', 'expire', 'remember',
-- 'remember-passed' or nothing), and recorded in known_keys with its token.
-- 'remember' finishes it to be remembered for a day and moves its times
-- back so that its retention passed a second ago; 'remember-passed' to be
-- remembered for a second, its retention an hour ago.
CREATE FUNCTION fuzz_data.seed_key(state text, scope text, lease interval,
								   then_do text, bound boolean DEFAULT false)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
	c idempotency.claim_result;
	k text := 'seed-' || state;
	req jsonb := jsonb_build_object('state', state, 'n', 1);
	ago interval := CASE then_do WHEN 'remember-passed' THEN interval '1 hour'
					  ELSE interval '1 second' END;
BEGIN
	-- remember => '0': keys not meant to be remembered are not, whatever
	-- idempotency.remember says
	SELECT * INTO c FROM idempotency.idem_claim(k, req, scope, lease => lease,
												session_bound => bound,
												remember => '0');
	CASE then_do
	WHEN 'finish' THEN
		PERFORM idempotency.idem_finish(k, c.token, 201, '{"ok": true}', scope);
	WHEN 'fail' THEN
		PERFORM idempotency.idem_finish(k, c.token, 422, '{"ok": false}', scope,
										status => 'failed');
	WHEN 'release' THEN
		PERFORM idempotency.idem_release(k, c.token, scope);
	WHEN 'checkpoint' THEN
		PERFORM idempotency.idem_checkpoint(k, c.token, 'step-1', '{"id": 7}', scope);
	WHEN 'expire' THEN
		PERFORM idempotency.idem_finish(k, c.token, 200, NULL, scope,
										retention => '1 millisecond');
	WHEN 'remember', 'remember-passed' THEN
		PERFORM idempotency.idem_checkpoint(k, c.token, 'step-1', '{"id": 7}', scope);
		PERFORM idempotency.idem_finish(k, c.token, 201, '{"ok": true}', scope,
			remember => CASE then_do WHEN 'remember' THEN interval '1 day'
						ELSE interval '1 second' END);
		UPDATE idempotency.keys AS r
		   SET created_at = r.created_at - d.shift, finished_at = r.finished_at - d.shift,
			   lease_until = r.lease_until - d.shift, expires_at = r.expires_at - d.shift,
			   sweep_at = r.expires_at - d.shift
		  FROM (SELECT r2.expires_at - clock_timestamp() + ago AS shift
				  FROM idempotency.keys AS r2
				 WHERE r2.scope = seed_key.scope AND r2.key = k) AS d
		 WHERE r.scope = seed_key.scope AND r.key = k;
	ELSE
		NULL;
	END CASE;
	INSERT INTO fuzz_data.known_keys
		VALUES (state, scope, k, c.token, req, lease, 'step-1',
				ARRAY[k, k || '-2'], ARRAY[c.token, c.token + 1]);
END;
$$;

SELECT fuzz_data.seed_key('pending', 'seed', '1 hour', NULL);
SELECT fuzz_data.seed_key('lease-ended', 'seed', '1 millisecond', NULL);
SELECT fuzz_data.seed_key('checkpointed', 'seed', '1 hour', 'checkpoint');
SELECT fuzz_data.seed_key('succeeded', 'seed', '1 hour', 'finish');
SELECT fuzz_data.seed_key('failed', 'seed', '1 hour', 'fail');
SELECT fuzz_data.seed_key('released', 'seed', '1 hour', 'release');
SELECT fuzz_data.seed_key('retention-passed', 'seed', '1 hour', 'expire');
SELECT fuzz_data.seed_key('remembered-compacted', 'seed', '1 hour', 'remember');
-- a sweep compacts it now (the background worker would within a second)
SELECT count(*) FROM idempotency.idem_sweep();
SELECT fuzz_data.seed_key('remembered', 'seed', '1 hour', 'remember');
SELECT fuzz_data.seed_key('remember-passed', 'seed', '1 hour', 'remember-passed');
SELECT fuzz_data.seed_key('tenant-pending', 'tenant:seed', '1 hour', NULL);
-- bound to this psql session, which ends when the script does
SELECT fuzz_data.seed_key('session-ended', 'seed', '1 hour', NULL, true);

CREATE FUNCTION fuzz_data.claim(key text, request jsonb, scope text,
								lease interval, retention interval,
								wait interval, session_bound boolean,
								remember interval)
RETURNS text LANGUAGE sql VOLATILE AS $$
	SELECT c::text FROM idempotency.idem_claim(key, request, scope, lease,
											   retention, wait, session_bound,
											   remember) c
$$;
CREATE FUNCTION fuzz_data.claim_many(keys text[], requests jsonb[], scope text,
									 lease interval, retention interval,
									 session_bound boolean)
RETURNS text LANGUAGE sql VOLATILE AS $$
	SELECT string_agg(c::text, ';') FROM idempotency.idem_claim_many(
		keys, requests, scope, lease, retention, session_bound) c
$$;
CREATE FUNCTION fuzz_data.finish_many(keys text[], tokens bigint[],
									  response_codes integer[],
									  response_bodies jsonb[], scope text,
									  status text, retention interval,
									  remember interval)
RETURNS text LANGUAGE sql VOLATILE AS $$
	SELECT string_agg(f::text, ';') FROM idempotency.idem_finish_many(
		keys, tokens, response_codes, response_bodies, scope, status, retention,
		remember) f
$$;
CREATE FUNCTION fuzz_data.lookup(key text, scope text)
RETURNS text LANGUAGE sql STABLE AS $$
	SELECT l::text FROM idempotency.idem_lookup(key, scope) l
$$;
CREATE FUNCTION fuzz_data.sweep(batch_size integer)
RETURNS text LANGUAGE sql VOLATILE AS $$
	SELECT s::text FROM idempotency.idem_sweep(batch_size) s
$$;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA fuzz_data FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fuzz_data.claim, fuzz_data.claim_many,
	fuzz_data.finish_many, fuzz_data.lookup, fuzz_data.sweep TO fuzz_smith;
