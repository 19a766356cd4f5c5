-- search_path.sql (pgTAP): the functions cannot be subverted through
-- search_path.  An unprivileged role plants, in a schema of its own put
-- first in search_path (before pg_catalog): operators (=, <>, <, <=, >, >=,
-- +, -) on the types the functions compare, functions named like
-- pg_catalog's (now, clock_timestamp, nextval, sha256, convert_to, length,
-- ...), domains named like the types (text, int4, int8, jsonb, bytea,
-- timestamptz), tables "keys" and "scope_bindings", a sequence "token_seq"
-- (and a temporary table "keys").  The attacker is bound to a scope prefix,
-- so the tenant check runs in every call.  Every planted object records its
-- use in evil.log.
-- Then the functions are called, as that role and as a superuser: the
-- answers are right, the real table holds the rows, and evil.log is empty.
-- A control step at the end shows the traps do fire when referenced.
\set ON_ERROR_STOP 1
-- sp3's first claim commits before the test's transaction, which takes it
-- over under the planted search_path (a transaction never takes over a
-- claim it holds itself)
SELECT outcome AS c1_outcome, token AS sp3, attempt AS c1_attempt
  FROM idempotency.idem_claim('sp3', '{"c": 3}', 'pgtap-sp', '1 second', '1 hour') \gset
BEGIN;
CREATE EXTENSION IF NOT EXISTS pgtap;
SELECT plan(19);

CREATE ROLE regress_idem_attacker NOLOGIN;
GRANT USAGE ON SCHEMA idempotency TO regress_idem_attacker;
CREATE SCHEMA evil AUTHORIZATION regress_idem_attacker;
GRANT USAGE ON SCHEMA evil TO PUBLIC;
CREATE TEMP TABLE results (step pg_catalog.text, outcome pg_catalog.text, token pg_catalog.int8,
	attempt pg_catalog.int4, status pg_catalog.text, response_code pg_catalog.int4,
	response_body pg_catalog.jsonb, retry_after pg_catalog.int4, phase pg_catalog.text,
	phase_data pg_catalog.jsonb);
CREATE TEMP TABLE stamps (step pg_catalog.text, ts pg_catalog.timestamptz);
CREATE TEMP TABLE errs (step pg_catalog.text, state pg_catalog.text);
CREATE TEMP TABLE ctl (ts pg_catalog.timestamptz, eq pg_catalog.bool);
GRANT ALL ON results, stamps, errs, ctl TO PUBLIC;

-- the attacker is a bound tenant: every call also checks its scope prefix
SELECT idempotency.bind_scope('regress_idem_attacker', 'pgtap-sp') \gset
SET ROLE regress_idem_attacker;
CREATE TABLE evil.log (what pg_catalog.text, by_user pg_catalog.text DEFAULT CURRENT_USER);
GRANT ALL ON evil.log TO PUBLIC;
CREATE FUNCTION evil.trap(what pg_catalog.text) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO evil.log (what) VALUES (what);
	RETURN true;
END $$;

-- operators
CREATE FUNCTION evil.eq_text(pg_catalog.text, pg_catalog.text) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('=(text,text)'); RETURN pg_catalog.texteq($1, $2); END $$;
CREATE OPERATOR evil.= (LEFTARG = pg_catalog.text, RIGHTARG = pg_catalog.text, FUNCTION = evil.eq_text);
CREATE FUNCTION evil.ne_text(pg_catalog.text, pg_catalog.text) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('<>(text,text)'); RETURN pg_catalog.textne($1, $2); END $$;
CREATE OPERATOR evil.<> (LEFTARG = pg_catalog.text, RIGHTARG = pg_catalog.text, FUNCTION = evil.ne_text);
CREATE FUNCTION evil.eq_int8(pg_catalog.int8, pg_catalog.int8) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('=(bigint,bigint)'); RETURN pg_catalog.int8eq($1, $2); END $$;
CREATE OPERATOR evil.= (LEFTARG = pg_catalog.int8, RIGHTARG = pg_catalog.int8, FUNCTION = evil.eq_int8);
CREATE FUNCTION evil.ne_int8(pg_catalog.int8, pg_catalog.int8) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('<>(bigint,bigint)'); RETURN pg_catalog.int8ne($1, $2); END $$;
CREATE OPERATOR evil.<> (LEFTARG = pg_catalog.int8, RIGHTARG = pg_catalog.int8, FUNCTION = evil.ne_int8);
CREATE FUNCTION evil.eq_text_int8(pg_catalog.text, pg_catalog.int8) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('=(text,bigint)'); RETURN pg_catalog.texteq($1, $2::pg_catalog.text); END $$;
CREATE OPERATOR evil.= (LEFTARG = pg_catalog.text, RIGHTARG = pg_catalog.int8, FUNCTION = evil.eq_text_int8);
CREATE FUNCTION evil.eq_int4(pg_catalog.int4, pg_catalog.int4) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('=(int,int)'); RETURN pg_catalog.int4eq($1, $2); END $$;
CREATE OPERATOR evil.= (LEFTARG = pg_catalog.int4, RIGHTARG = pg_catalog.int4, FUNCTION = evil.eq_int4);
CREATE FUNCTION evil.eq_bytea(pg_catalog.bytea, pg_catalog.bytea) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('=(bytea,bytea)'); RETURN pg_catalog.byteaeq($1, $2); END $$;
CREATE OPERATOR evil.= (LEFTARG = pg_catalog.bytea, RIGHTARG = pg_catalog.bytea, FUNCTION = evil.eq_bytea);
CREATE FUNCTION evil.eq_jsonb(pg_catalog.jsonb, pg_catalog.jsonb) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('=(jsonb,jsonb)'); RETURN pg_catalog.jsonb_eq($1, $2); END $$;
CREATE OPERATOR evil.= (LEFTARG = pg_catalog.jsonb, RIGHTARG = pg_catalog.jsonb, FUNCTION = evil.eq_jsonb);
CREATE FUNCTION evil.lt_tstz(pg_catalog.timestamptz, pg_catalog.timestamptz) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('<(timestamptz)'); RETURN pg_catalog.timestamptz_lt($1, $2); END $$;
CREATE OPERATOR evil.< (LEFTARG = pg_catalog.timestamptz, RIGHTARG = pg_catalog.timestamptz, FUNCTION = evil.lt_tstz);
CREATE FUNCTION evil.le_tstz(pg_catalog.timestamptz, pg_catalog.timestamptz) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('<=(timestamptz)'); RETURN pg_catalog.timestamptz_le($1, $2); END $$;
CREATE OPERATOR evil.<= (LEFTARG = pg_catalog.timestamptz, RIGHTARG = pg_catalog.timestamptz, FUNCTION = evil.le_tstz);
CREATE FUNCTION evil.gt_tstz(pg_catalog.timestamptz, pg_catalog.timestamptz) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('>(timestamptz)'); RETURN pg_catalog.timestamptz_gt($1, $2); END $$;
CREATE OPERATOR evil.> (LEFTARG = pg_catalog.timestamptz, RIGHTARG = pg_catalog.timestamptz, FUNCTION = evil.gt_tstz);
CREATE FUNCTION evil.ge_tstz(pg_catalog.timestamptz, pg_catalog.timestamptz) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('>=(timestamptz)'); RETURN pg_catalog.timestamptz_ge($1, $2); END $$;
CREATE OPERATOR evil.>= (LEFTARG = pg_catalog.timestamptz, RIGHTARG = pg_catalog.timestamptz, FUNCTION = evil.ge_tstz);
CREATE FUNCTION evil.pl_tstz(pg_catalog.timestamptz, pg_catalog.interval) RETURNS pg_catalog.timestamptz
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('+(timestamptz,interval)'); RETURN pg_catalog.timestamptz_pl_interval($1, $2); END $$;
CREATE OPERATOR evil.+ (LEFTARG = pg_catalog.timestamptz, RIGHTARG = pg_catalog.interval, FUNCTION = evil.pl_tstz);
CREATE FUNCTION evil.mi_tstz(pg_catalog.timestamptz, pg_catalog.timestamptz) RETURNS pg_catalog.interval
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('-(timestamptz,timestamptz)'); RETURN pg_catalog.timestamptz_mi($1, $2); END $$;
CREATE OPERATOR evil.- (LEFTARG = pg_catalog.timestamptz, RIGHTARG = pg_catalog.timestamptz, FUNCTION = evil.mi_tstz);
CREATE FUNCTION evil.pl_int4(pg_catalog.int4, pg_catalog.int4) RETURNS pg_catalog.int4
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('+(int,int)'); RETURN pg_catalog.int4pl($1, $2); END $$;
CREATE OPERATOR evil.+ (LEFTARG = pg_catalog.int4, RIGHTARG = pg_catalog.int4, FUNCTION = evil.pl_int4);

CREATE FUNCTION evil.eq_oid(pg_catalog.oid, pg_catalog.oid) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('=(oid,oid)'); RETURN pg_catalog.oideq($1, $2); END $$;
CREATE OPERATOR evil.= (LEFTARG = pg_catalog.oid, RIGHTARG = pg_catalog.oid, FUNCTION = evil.eq_oid);
CREATE FUNCTION evil.like_text(pg_catalog.text, pg_catalog.text) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('~~(text,text)'); RETURN pg_catalog.textlike($1, $2); END $$;
CREATE OPERATOR evil.~~ (LEFTARG = pg_catalog.text, RIGHTARG = pg_catalog.text, FUNCTION = evil.like_text);
CREATE FUNCTION evil.starts_with(pg_catalog.text, pg_catalog.text) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('starts_with()'); RETURN pg_catalog.starts_with($1, $2); END $$;
CREATE FUNCTION evil.left(pg_catalog.text, pg_catalog.int4) RETURNS pg_catalog.text
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('left()'); RETURN pg_catalog.left($1, $2); END $$;
CREATE FUNCTION evil.substr(pg_catalog.text, pg_catalog.int4, pg_catalog.int4) RETURNS pg_catalog.text
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('substr()'); RETURN pg_catalog.substr($1, $2, $3); END $$;
CREATE TABLE evil.scope_bindings (role pg_catalog.regrole, scope_prefix pg_catalog.text);
GRANT ALL ON evil.scope_bindings TO PUBLIC;

-- functions named like pg_catalog's
CREATE FUNCTION evil.now() RETURNS pg_catalog.timestamptz
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('now()'); RETURN pg_catalog.now(); END $$;
CREATE FUNCTION evil.clock_timestamp() RETURNS pg_catalog.timestamptz
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('clock_timestamp()'); RETURN pg_catalog.clock_timestamp(); END $$;
CREATE FUNCTION evil.statement_timestamp() RETURNS pg_catalog.timestamptz
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('statement_timestamp()'); RETURN pg_catalog.statement_timestamp(); END $$;
CREATE FUNCTION evil.nextval(pg_catalog.regclass) RETURNS pg_catalog.int8
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('nextval()'); RETURN pg_catalog.nextval($1); END $$;
CREATE FUNCTION evil.sha256(pg_catalog.bytea) RETURNS pg_catalog.bytea
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('sha256()'); RETURN pg_catalog.sha256($1); END $$;
CREATE FUNCTION evil.convert_to(pg_catalog.text, pg_catalog.name) RETURNS pg_catalog.bytea
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('convert_to()'); RETURN pg_catalog.convert_to($1, $2); END $$;
CREATE FUNCTION evil.length(pg_catalog.text) RETURNS pg_catalog.int4
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('length()'); RETURN pg_catalog.length($1); END $$;
CREATE FUNCTION evil.char_length(pg_catalog.text) RETURNS pg_catalog.int4
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('char_length()'); RETURN pg_catalog.char_length($1); END $$;
CREATE FUNCTION evil.octet_length(pg_catalog.text) RETURNS pg_catalog.int4
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('octet_length()'); RETURN pg_catalog.octet_length($1); END $$;
CREATE FUNCTION evil.pg_try_advisory_xact_lock(pg_catalog.int8) RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('pg_try_advisory_xact_lock()'); RETURN pg_catalog.pg_try_advisory_xact_lock($1); END $$;
CREATE FUNCTION evil.hashtextextended(pg_catalog.text, pg_catalog.int8) RETURNS pg_catalog.int8
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('hashtextextended()'); RETURN pg_catalog.hashtextextended($1, $2); END $$;
CREATE FUNCTION evil.greatest_tstz(pg_catalog.timestamptz, pg_catalog.timestamptz) RETURNS pg_catalog.timestamptz
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('timestamptz_larger()'); RETURN pg_catalog.timestamptz_larger($1, $2); END $$;
CREATE FUNCTION evil.timestamptz_larger(pg_catalog.timestamptz, pg_catalog.timestamptz) RETURNS pg_catalog.timestamptz
LANGUAGE plpgsql AS $$ BEGIN PERFORM evil.trap('timestamptz_larger()'); RETURN pg_catalog.timestamptz_larger($1, $2); END $$;

-- look-alike relations
CREATE TABLE evil.keys (scope pg_catalog.text, key pg_catalog.text, status pg_catalog.text,
	token pg_catalog.int8, attempt pg_catalog.int4, fingerprint pg_catalog.bytea,
	response_code pg_catalog.int4, response_body pg_catalog.jsonb,
	created_at pg_catalog.timestamptz, finished_at pg_catalog.timestamptz,
	lease_until pg_catalog.timestamptz, expires_at pg_catalog.timestamptz,
	retention pg_catalog.interval, sweep_at pg_catalog.timestamptz);
GRANT ALL ON evil.keys TO PUBLIC;
CREATE TEMP TABLE keys (LIKE evil.keys);
GRANT ALL ON pg_temp.keys TO PUBLIC;
CREATE SEQUENCE evil.token_seq START 1000000000000;
GRANT ALL ON evil.token_seq TO PUBLIC;
CREATE FUNCTION evil.keys_trap() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM evil.trap('keys ' || TG_OP); RETURN NEW; END $$;
CREATE TRIGGER keys_trap BEFORE INSERT OR UPDATE OR DELETE ON evil.keys
	FOR EACH ROW EXECUTE FUNCTION evil.keys_trap();

-- domains named like the types (created last: from here on an unqualified
-- type name in this search_path means the domain)
CREATE DOMAIN evil.text AS pg_catalog.text CHECK (evil.trap('domain text') OR VALUE IS NULL);
CREATE DOMAIN evil.int4 AS pg_catalog.int4 CHECK (evil.trap('domain int4') OR VALUE IS NULL);
CREATE DOMAIN evil.int8 AS pg_catalog.int8 CHECK (evil.trap('domain int8') OR VALUE IS NULL);
CREATE DOMAIN evil.jsonb AS pg_catalog.jsonb CHECK (evil.trap('domain jsonb') OR VALUE IS NULL);
CREATE DOMAIN evil.bytea AS pg_catalog.bytea CHECK (evil.trap('domain bytea') OR VALUE IS NULL);
CREATE DOMAIN evil.timestamptz AS pg_catalog.timestamptz CHECK (evil.trap('domain timestamptz') OR VALUE IS NULL);
CREATE DOMAIN evil.varchar AS pg_catalog.varchar CHECK (evil.trap('domain varchar') OR VALUE IS NULL);

--
-- The attack: every function called with the planted objects first in
-- search_path, as the attacker (who has USAGE on idempotency) ...
--
SET search_path = evil, pg_catalog, public;
INSERT INTO results SELECT 'a1 claim', * FROM idempotency.idem_claim('sp1', '{"a": 1}', 'pgtap-sp') RETURNING token AS sp1 \gset
INSERT INTO results SELECT 'a2 claim again', * FROM idempotency.idem_claim('sp1', '{"a": 1}', 'pgtap-sp');
INSERT INTO results SELECT 'a3 other request', * FROM idempotency.idem_claim('sp1', '{"a": 2}', 'pgtap-sp');
INSERT INTO stamps SELECT 'a4 extend', idempotency.idem_extend('sp1', :sp1, '10 minutes', 'pgtap-sp');
INSERT INTO stamps SELECT 'a5 finish', idempotency.idem_finish('sp1', :sp1, 201, '{"r": 1}', 'pgtap-sp', 'succeeded', '2 hours');
INSERT INTO stamps SELECT 'a6 finish again', idempotency.idem_finish('sp1', :sp1, 201, '{"r": 1}', 'pgtap-sp');
INSERT INTO results SELECT 'a7 replay', * FROM idempotency.idem_claim('sp1', '{"a": 1}', 'pgtap-sp');
INSERT INTO results SELECT 'a8 lookup', 'lookup', NULL, attempt, status, response_code, response_body, NULL
  FROM idempotency.idem_lookup('sp1', 'pgtap-sp');
INSERT INTO results SELECT 'b1 claim', * FROM idempotency.idem_claim('sp2', NULL, 'pgtap-sp') RETURNING token AS sp2 \gset
SELECT idempotency.idem_release('sp2', :sp2, 'pgtap-sp') \gset
INSERT INTO results SELECT 'b2 lookup released', 'lookup', NULL, attempt, status, response_code, response_body, NULL
  FROM idempotency.idem_lookup('sp2', 'pgtap-sp');
INSERT INTO results (step, outcome, token, attempt) VALUES ('c1 claim', :'c1_outcome', :sp3, :c1_attempt);
SELECT pg_catalog.pg_sleep(1.1) \gset
INSERT INTO results SELECT 'c2 takeover', * FROM idempotency.idem_claim('sp3', '{"c": 3}', 'pgtap-sp', wait => '1 second');
DO $$
BEGIN
	BEGIN
		PERFORM idempotency.idem_finish('sp3', -1, 200, NULL, 'pgtap-sp');
	EXCEPTION WHEN OTHERS THEN
		INSERT INTO pg_temp.errs VALUES ('d1 dead token', SQLSTATE);
	END;
	BEGIN
		PERFORM idempotency.idem_finish('sp1', -1, 200, NULL, 'pgtap-sp');
	EXCEPTION WHEN OTHERS THEN
		INSERT INTO pg_temp.errs VALUES ('d2 finished by another token', SQLSTATE);
	END;
	BEGIN
		PERFORM idempotency.idem_release('absent', 1, 'pgtap-sp');
	EXCEPTION WHEN OTHERS THEN
		INSERT INTO pg_temp.errs VALUES ('d3 absent', SQLSTATE);
	END;
	BEGIN
		PERFORM idempotency.idem_claim('', NULL, 'pgtap-sp');
	EXCEPTION WHEN OTHERS THEN
		INSERT INTO pg_temp.errs VALUES ('d4 empty key', SQLSTATE);
	END;
	BEGIN
		PERFORM idempotency.idem_sweep(10);
	EXCEPTION WHEN OTHERS THEN
		INSERT INTO pg_temp.errs VALUES ('d5 sweep as attacker', SQLSTATE);
	END;
	BEGIN
		PERFORM idempotency.idem_claim('k', NULL, 'other-tenant');
	EXCEPTION WHEN OTHERS THEN
		INSERT INTO pg_temp.errs VALUES ('d6 another tenant''s scope', SQLSTATE);
	END;
END $$;

-- ... and as a superuser with the same search_path
RESET ROLE;
INSERT INTO results SELECT 'e1 claim as superuser', * FROM idempotency.idem_claim('sp4', '{"e": 4}', 'pgtap-sp') RETURNING token AS sp4 \gset
INSERT INTO stamps SELECT 'e2 finish as superuser', idempotency.idem_finish('sp4', :sp4, 200, '{"r": 4}', 'pgtap-sp', 'failed');
INSERT INTO results SELECT 'e3 replay as superuser', * FROM idempotency.idem_claim('sp4', '{"e": 4}', 'pgtap-sp');
INSERT INTO results SELECT 'e4 sweep as superuser', 'sweep', expired, NULL, NULL, NULL, NULL, NULL FROM idempotency.idem_sweep(100);
RESET search_path;

--
-- The verdict, with a clean search_path
--
SELECT is((SELECT count(*)::int FROM evil.log), 0, 'no planted object was ever invoked');
SELECT is((SELECT string_agg(DISTINCT what, ', ') FROM evil.log), NULL, 'nothing in evil.log');
SELECT is((SELECT count(*)::int FROM evil.keys), 0, 'the look-alike evil.keys is untouched');
SELECT is((SELECT count(*)::int FROM pg_temp.keys), 0, 'the temporary look-alike keys is untouched');
SELECT is((SELECT is_called FROM evil.token_seq), false, 'the look-alike token_seq was never called');
SELECT results_eq(
	$$SELECT step, outcome, token IS NOT NULL, attempt, status, response_code, response_body
	    FROM results WHERE step NOT LIKE 'e4%' ORDER BY step$$,
	$$VALUES ('a1 claim', 'claimed', true, 1, NULL, NULL, NULL::jsonb),
	         ('a2 claim again', 'in_progress', false, NULL, NULL, NULL, NULL),
	         ('a3 other request', 'mismatch', false, NULL, NULL, NULL, NULL),
	         ('a7 replay', 'replay', false, NULL, 'succeeded', 201, '{"r": 1}'),
	         ('a8 lookup', 'lookup', false, 1, 'succeeded', 201, '{"r": 1}'),
	         ('b1 claim', 'claimed', true, 1, NULL, NULL, NULL),
	         ('c1 claim', 'claimed', true, 1, NULL, NULL, NULL),
	         ('c2 takeover', 'claimed', true, 2, NULL, NULL, NULL),
	         ('e1 claim as superuser', 'claimed', true, 1, NULL, NULL, NULL),
	         ('e3 replay as superuser', 'replay', false, NULL, 'failed', 200, '{"r": 4}')$$,
	'every call answered correctly under the hostile search_path');
SELECT ok((SELECT retry_after BETWEEN 1 AND 30 FROM results WHERE step = 'a2 claim again'),
          'in_progress carried a sane retry_after');
SELECT ok((SELECT (SELECT token FROM results WHERE step = 'c2 takeover')
                > (SELECT token FROM results WHERE step = 'c1 claim')),
          'the takeover token is larger');
SELECT is((SELECT count(*)::int FROM results WHERE step = 'b2 lookup released'), 0,
          'the released key was gone for lookup');
SELECT results_eq($$SELECT step, state FROM errs ORDER BY step$$,
                  $$VALUES ('d1 dead token'::text, '55006'::text),
                           ('d2 finished by another token', '55000'),
                           ('d3 absent', 'P0002'),
                           ('d4 empty key', '22023'),
                           ('d5 sweep as attacker', '42501'),
                           ('d6 another tenant''s scope', '42501')$$,
                  'errors kept their SQLSTATEs under the hostile search_path');
SELECT ok((SELECT ts > now() + interval '9 minutes' FROM stamps WHERE step = 'a4 extend'),
          'extend returned the new lease deadline');
SELECT ok((SELECT ts BETWEEN now() + interval '1 hour 59 minutes' AND clock_timestamp() + interval '2 hours'
             FROM stamps WHERE step = 'a5 finish'),
          'finish returned the expiry (finish retention 2 hours)');
SELECT is((SELECT ts FROM stamps WHERE step = 'a6 finish again'),
          (SELECT ts FROM stamps WHERE step = 'a5 finish'),
          'the repeated finish returned the same expiry');
SELECT results_eq(
	$$SELECT key COLLATE "default", status COLLATE "default", attempt, response_code, response_body
	    FROM idempotency.keys
	   WHERE scope = 'pgtap-sp' ORDER BY key$$,
	$$VALUES ('sp1'::text, 'succeeded'::text, 1, 201, '{"r": 1}'::jsonb),
	         ('sp3', 'pending', 2, NULL, NULL),
	         ('sp4', 'failed', 1, 200, '{"r": 4}')$$,
	'the real idempotency.keys holds the rows');
SELECT ok((SELECT fingerprint = sha256(convert_to('{"a": 1}'::jsonb::text, 'UTF8'))
             FROM idempotency.keys WHERE scope = 'pgtap-sp' AND key = 'sp1'),
          'the fingerprint is the real SHA-256');
SELECT ok((SELECT token = :sp1 FROM idempotency.keys WHERE scope = 'pgtap-sp' AND key = 'sp1'),
          'the stored token is the one claim returned');
SELECT cmp_ok((SELECT last_value FROM idempotency.token_seq), '>=', :sp4::bigint,
              'the tokens came from idempotency.token_seq');

--
-- Control: the traps do fire when something refers to them unqualified.
--
SET search_path = evil, pg_catalog, public;
INSERT INTO ctl SELECT now(), 'x'::pg_catalog.text = 'x'::pg_catalog.text;
RESET search_path;
SELECT is((SELECT string_agg(what, ', ' ORDER BY what COLLATE "C") FROM evil.log), '=(text,text), now()',
          'control: unqualified now() and = hit the traps');
SELECT is((SELECT count(*)::int FROM ctl WHERE eq), 1, 'control: and still gave the right answer');

SELECT * FROM finish();
ROLLBACK;
