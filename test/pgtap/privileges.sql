-- privileges.sql (pgTAP): application roles use the functions and nothing
-- else.  The schema's USAGE is the DBA's grant; the client functions are
-- EXECUTE for PUBLIC (idem_claim_abandoned too); idem_sweep, idem_forget
-- and distribute are not; the stats and cluster_stats views are readable
-- by PUBLIC; the table and the sequence are nobody's but the owner's.
\set ON_ERROR_STOP 1
BEGIN;
CREATE EXTENSION IF NOT EXISTS pgtap;
SELECT plan(92);

CREATE ROLE regress_idem_app NOLOGIN;
CREATE ROLE regress_idem_nousage NOLOGIN;
CREATE ROLE regress_idem_sweeper NOLOGIN;
GRANT USAGE ON SCHEMA idempotency TO regress_idem_app, regress_idem_sweeper;
GRANT EXECUTE ON FUNCTION idempotency.idem_sweep(integer) TO regress_idem_sweeper;

-- the catalog view of it
SELECT ok(NOT has_schema_privilege('public', 'idempotency', 'USAGE'),
          'PUBLIC has no USAGE on schema idempotency');
SELECT ok(NOT has_schema_privilege('regress_idem_nousage', 'idempotency', 'USAGE'),
          'a role without the grant has no USAGE');
SELECT ok(NOT has_schema_privilege('regress_idem_app', 'idempotency', 'CREATE'),
          'the app role cannot create objects in schema idempotency');
SELECT ok(has_function_privilege('public', 'idempotency.idem_claim(text,jsonb,text,interval,interval,interval,boolean,interval,boolean)', 'EXECUTE'),
          'PUBLIC may execute idem_claim');
SELECT ok(has_function_privilege('public', 'idempotency.idem_claim_abandoned(text,integer,interval)', 'EXECUTE'),
          'PUBLIC may execute idem_claim_abandoned');
SELECT ok(has_function_privilege('public', 'idempotency.idem_finish(text,bigint,integer,jsonb,text,text,interval,interval)', 'EXECUTE'),
          'PUBLIC may execute idem_finish');
SELECT ok(has_function_privilege('public', 'idempotency.idem_extend(text,bigint,interval,text)', 'EXECUTE'),
          'PUBLIC may execute idem_extend');
SELECT ok(has_function_privilege('public', 'idempotency.idem_release(text,bigint,text)', 'EXECUTE'),
          'PUBLIC may execute idem_release');
SELECT ok(has_function_privilege('public', 'idempotency.idem_lookup(text,text)', 'EXECUTE'),
          'PUBLIC may execute idem_lookup');
SELECT ok(has_function_privilege('public', 'idempotency.idem_version()', 'EXECUTE'),
          'PUBLIC may execute idem_version');
SELECT ok(has_function_privilege('public', 'idempotency.idem_checkpoint(text,bigint,text,jsonb,text)', 'EXECUTE'),
          'PUBLIC may execute idem_checkpoint');
SELECT ok(has_function_privilege('public', 'idempotency.idem_claim_many(text[],jsonb[],text,interval,interval,boolean)', 'EXECUTE'),
          'PUBLIC may execute idem_claim_many');
SELECT ok(has_function_privilege('public', 'idempotency.idem_finish_many(text[],bigint[],integer[],jsonb[],text,text,interval,interval)', 'EXECUTE'),
          'PUBLIC may execute idem_finish_many');
SELECT ok(NOT has_function_privilege('public', 'idempotency.idem_sweep(integer)', 'EXECUTE'),
          'PUBLIC may not execute idem_sweep');
SELECT ok(NOT has_function_privilege('regress_idem_app', 'idempotency.idem_sweep(integer)', 'EXECUTE'),
          'the app role may not execute idem_sweep');
SELECT ok(NOT has_function_privilege('public', 'idempotency.idem_forget(text,text)', 'EXECUTE'),
          'PUBLIC may not execute idem_forget');
SELECT ok(NOT has_function_privilege('regress_idem_app', 'idempotency.idem_forget(text,text)', 'EXECUTE'),
          'the app role may not execute idem_forget');
SELECT table_privs_are('idempotency', 'keys', 'public', ARRAY[]::name[],
                       'PUBLIC has no privilege on idempotency.keys');
SELECT table_privs_are('idempotency', 'keys', 'regress_idem_app', ARRAY[]::name[],
                       'the app role has no privilege on idempotency.keys');
SELECT sequence_privs_are('idempotency', 'token_seq', 'public', ARRAY[]::name[],
                          'PUBLIC has no privilege on idempotency.token_seq');
SELECT sequence_privs_are('idempotency', 'token_seq', 'regress_idem_app', ARRAY[]::name[],
                          'the app role has no privilege on idempotency.token_seq');
SELECT ok(NOT has_function_privilege('public', 'idempotency.stats_reset()', 'EXECUTE'),
          'PUBLIC may not execute stats_reset');
SELECT ok(NOT has_function_privilege('public', 'idempotency.bind_scope(regrole,text)', 'EXECUTE'),
          'PUBLIC may not execute bind_scope');
SELECT ok(NOT has_function_privilege('public', 'idempotency.unbind_scope(regrole)', 'EXECUTE'),
          'PUBLIC may not execute unbind_scope');
SELECT table_privs_are('idempotency', 'scope_bindings', 'public', ARRAY[]::name[],
                       'PUBLIC has no privilege on idempotency.scope_bindings');
SELECT table_privs_are('idempotency', 'stats', 'public', ARRAY['SELECT']::name[],
                       'PUBLIC may read the stats view');
SELECT ok(NOT has_function_privilege('public', 'idempotency.distribute(integer)', 'EXECUTE'),
          'PUBLIC may not execute distribute');
SELECT ok(NOT has_function_privilege('regress_idem_app', 'idempotency.distribute(integer)', 'EXECUTE'),
          'the app role may not execute distribute');
SELECT table_privs_are('idempotency', 'cluster_stats', 'public', ARRAY['SELECT']::name[],
                       'PUBLIC may read the cluster_stats view');
-- a view's functions run with the reader's EXECUTE privilege
SELECT ok(has_function_privilege('public', 'idempotency.cluster_stats_rows()', 'EXECUTE'),
          'PUBLIC may execute cluster_stats_rows, which the view calls');
SELECT ok(NOT EXISTS (SELECT 1 FROM pg_attribute
                       WHERE attrelid = 'idempotency.keys'::regclass AND attnum > 0
                         AND attacl IS NOT NULL),
          'no column-level grants on idempotency.keys');

--
-- As the application role (USAGE on the schema, nothing else)
--
CREATE TEMP TABLE tok (name text PRIMARY KEY, token bigint);
GRANT ALL ON tok TO PUBLIC;
SET ROLE regress_idem_app;
SELECT is(current_user::text, 'regress_idem_app', 'now running as the app role');

INSERT INTO tok SELECT 'p1', token FROM idempotency.idem_claim('p1', '{"a": 1}', 'pgtap-priv');
SELECT isnt((SELECT token FROM tok WHERE name = 'p1'), NULL, 'the app role claims a key');
SELECT results_eq($$SELECT outcome, token, retry_after > 0
                      FROM idempotency.idem_claim('p1', '{"a": 1}', 'pgtap-priv')$$,
                  $$VALUES ('in_progress'::text, NULL::bigint, true)$$,
                  'and sees its own claim in progress');
SELECT is((SELECT outcome FROM idempotency.idem_claim('p1', '{"a": 2}', 'pgtap-priv')), 'mismatch',
          'and gets a mismatch for another request');
SELECT cmp_ok(idempotency.idem_extend('p1', (SELECT token FROM tok WHERE name = 'p1'), '5 minutes', 'pgtap-priv'),
              '>', now() + interval '4 minutes', 'the app role extends its claim');
SELECT cmp_ok(idempotency.idem_finish('p1', (SELECT token FROM tok WHERE name = 'p1'), 201, '{"id": 1}', 'pgtap-priv'),
              '>', now(), 'the app role finishes its claim');
SELECT results_eq($$SELECT outcome, response_code, response_body
                      FROM idempotency.idem_claim('p1', '{"a": 1}', 'pgtap-priv')$$,
                  $$VALUES ('replay'::text, 201, '{"id": 1}'::jsonb)$$,
                  'the app role gets the replay');
SELECT results_eq($$SELECT status, attempt, response_code FROM idempotency.idem_lookup('p1', 'pgtap-priv')$$,
                  $$VALUES ('succeeded'::text, 1, 201)$$,
                  'the app role looks the key up');
INSERT INTO tok SELECT 'p2', token FROM idempotency.idem_claim('p2', scope => 'pgtap-priv');
SELECT lives_ok($$SELECT idempotency.idem_release('p2', (SELECT token FROM tok WHERE name = 'p2'), 'pgtap-priv')$$,
                'the app role releases a claim');
SELECT is((SELECT count(*)::int FROM idempotency.idem_lookup('p2', 'pgtap-priv')), 0,
          'and the released key is gone');
SELECT throws_ok($$SELECT idempotency.idem_finish('p2', (SELECT token FROM tok WHERE name = 'p2'), 200, NULL, 'pgtap-priv')$$,
                 'P0002', NULL, 'the app role gets the regular errors (absent key)');
SELECT throws_ok($$SELECT idempotency.idem_claim('', scope => 'pgtap-priv')$$,
                 '22023', NULL, 'and bad input errors');
SELECT is((SELECT outcome FROM idempotency.idem_claim('p3', '{"a": 3}', 'pgtap-priv', lease => '1 hour',
                                                      keep_request => true)),
          'claimed', 'the app role claims a key keeping its request');
SELECT is((SELECT count(*)::int FROM idempotency.idem_claim_abandoned('pgtap-priv', 10)), 0,
          'the app role calls idem_claim_abandoned: no key of the scope is abandoned');
SELECT is(current_user::text, 'regress_idem_app', 'the functions gave the caller its identity back');

-- no direct access to the table
SELECT throws_ok('SELECT * FROM idempotency.keys', '42501', NULL, 'the app role cannot SELECT keys');
SELECT throws_ok('SELECT count(*) FROM idempotency.keys', '42501', NULL, 'nor count them');
SELECT throws_ok($$INSERT INTO idempotency.keys (scope, key, status, attempt, created_at, expires_at,
                       retention, sweep_at) VALUES ('pgtap-priv', 'forged', 'succeeded', 1, now(),
                       now() + interval '1 day', '1 day', now() + interval '1 day')$$,
                 '42501', NULL, 'the app role cannot INSERT into keys');
SELECT throws_ok($$UPDATE idempotency.keys SET response_body = '{"forged": true}'$$,
                 '42501', NULL, 'the app role cannot UPDATE keys');
SELECT throws_ok('DELETE FROM idempotency.keys', '42501', NULL, 'the app role cannot DELETE from keys');
SELECT throws_ok('TRUNCATE idempotency.keys', '42501', NULL, 'the app role cannot TRUNCATE keys');
SELECT throws_ok('SELECT 1 FROM idempotency.keys FOR UPDATE', '42501', NULL, 'the app role cannot lock keys rows');
SELECT throws_ok('LOCK TABLE idempotency.keys', '42501', NULL, 'the app role cannot LOCK keys');
SELECT throws_ok('ALTER TABLE idempotency.keys ADD COLUMN x int', '42501', NULL, 'the app role cannot ALTER keys');
SELECT throws_ok('CREATE TABLE idempotency.mine (x int)', '42501', NULL, 'the app role cannot create in the schema');
-- nor to the sequence
SELECT throws_ok($$SELECT nextval('idempotency.token_seq')$$, '42501', NULL, 'the app role cannot draw a token');
SELECT throws_ok($$SELECT setval('idempotency.token_seq', 1)$$, '42501', NULL, 'the app role cannot move token_seq back');
SELECT throws_ok('SELECT last_value FROM idempotency.token_seq', '42501', NULL, 'the app role cannot read token_seq');
SELECT throws_ok($$SELECT currval('idempotency.token_seq')$$, '42501', NULL, 'the app role cannot use currval');
-- nor to the sweeper
SELECT throws_ok('SELECT * FROM idempotency.idem_sweep()', '42501', NULL, 'the app role cannot call idem_sweep');
SELECT throws_ok('SELECT * FROM idempotency.idem_sweep(10)', '42501', NULL, 'with a batch size neither');
-- nor to the operations functions and the bindings
SELECT throws_ok('SELECT idempotency.stats_reset()', '42501', NULL, 'the app role cannot reset the stats');
SELECT throws_ok($$SELECT idempotency.bind_scope('regress_idem_app', '')$$, '42501', NULL,
                 'the app role cannot bind itself to a scope');
SELECT throws_ok($$SELECT idempotency.unbind_scope('regress_idem_app')$$, '42501', NULL,
                 'the app role cannot unbind a scope');
SELECT throws_ok('SELECT * FROM idempotency.scope_bindings', '42501', NULL, 'the app role cannot read the bindings');
SELECT throws_ok($$INSERT INTO idempotency.scope_bindings VALUES ('regress_idem_app', '')$$, '42501', NULL,
                 'the app role cannot write the bindings');
-- the stats view is readable, and shows this database
SELECT is((SELECT count(*)::int FROM idempotency.stats WHERE database = current_database()), 1,
          'the app role reads its database''s stats row');
SELECT cmp_ok((SELECT succeeded FROM idempotency.stats WHERE database = current_database()), '>=', 1::bigint,
              'with the key counts it has no table privilege for');
SELECT is((SELECT key_counts_exact FROM idempotency.stats WHERE database = current_database()), true,
          'counted exactly on a small table');
SELECT throws_ok('SELECT idempotency.distribute()', '42501', NULL,
                 'the app role cannot distribute the table');
SELECT throws_ok('SELECT idempotency.distribute(4)', '42501', NULL, 'with a shard count neither');
SELECT results_eq($$SELECT node, succeeded FROM idempotency.cluster_stats$$,
                  $$SELECT 'local'::text, succeeded FROM idempotency.stats WHERE database = current_database()$$,
                  'the app role reads cluster_stats: this server''s row, as in stats');
RESET ROLE;

-- the rows the app role made are real and owned by nobody but the table
SELECT results_eq($$SELECT key COLLATE "default", status COLLATE "default" FROM idempotency.keys
                     WHERE scope = 'pgtap-priv' ORDER BY key$$,
                  $$VALUES ('p1'::text, 'succeeded'::text), ('p3'::text, 'pending'::text)$$,
                  'the app role''s calls changed the real table');
SELECT ok(NOT EXISTS (SELECT 1 FROM idempotency.keys WHERE key = 'forged'), 'nothing forged');

--
-- A role granted idem_sweep (the DBA's choice) sweeps without any table
-- privilege
--
SET ROLE regress_idem_sweeper;
SELECT lives_ok('SELECT * FROM idempotency.idem_sweep(10)', 'a role granted idem_sweep can sweep');
SELECT throws_ok('SELECT * FROM idempotency.keys', '42501', NULL, 'but still cannot read keys');
RESET ROLE;

--
-- Without USAGE on the schema nothing is reachable
--
SET ROLE regress_idem_nousage;
SELECT throws_ok($$SELECT * FROM idempotency.idem_claim('n1', scope => 'pgtap-priv')$$,
                 '42501', NULL, 'no USAGE: idem_claim refused');
SELECT throws_ok($$SELECT idempotency.idem_finish('p1', 1, 200, NULL, 'pgtap-priv')$$,
                 '42501', NULL, 'no USAGE: idem_finish refused');
SELECT throws_ok($$SELECT idempotency.idem_extend('p1', 1, '1 minute', 'pgtap-priv')$$,
                 '42501', NULL, 'no USAGE: idem_extend refused');
SELECT throws_ok($$SELECT idempotency.idem_release('p1', 1, 'pgtap-priv')$$,
                 '42501', NULL, 'no USAGE: idem_release refused');
SELECT throws_ok($$SELECT * FROM idempotency.idem_lookup('p1', 'pgtap-priv')$$,
                 '42501', NULL, 'no USAGE: idem_lookup refused');
SELECT throws_ok($$SELECT idempotency.idem_checkpoint('p1', 1, 'step', NULL, 'pgtap-priv')$$,
                 '42501', NULL, 'no USAGE: idem_checkpoint refused');
SELECT throws_ok($$SELECT * FROM idempotency.idem_claim_many(ARRAY['n1'], scope => 'pgtap-priv')$$,
                 '42501', NULL, 'no USAGE: idem_claim_many refused');
SELECT throws_ok($$SELECT * FROM idempotency.idem_finish_many(ARRAY['p1'], ARRAY[1::bigint], scope => 'pgtap-priv')$$,
                 '42501', NULL, 'no USAGE: idem_finish_many refused');
SELECT throws_ok($$SELECT * FROM idempotency.idem_claim_abandoned('pgtap-priv')$$,
                 '42501', NULL, 'no USAGE: idem_claim_abandoned refused');
SELECT throws_ok('SELECT * FROM idempotency.idem_sweep()',
                 '42501', NULL, 'no USAGE: idem_sweep refused');
SELECT throws_ok('SELECT * FROM idempotency.keys',
                 '42501', NULL, 'no USAGE: keys refused');
SELECT throws_ok($$SELECT nextval('idempotency.token_seq')$$,
                 '42501', NULL, 'no USAGE: token_seq refused');
RESET ROLE;
SELECT is((SELECT count(*)::int FROM idempotency.keys WHERE scope = 'pgtap-priv' AND key = 'n1'), 0,
          'the refused claim left nothing');

--
-- PUBLIC's EXECUTE can be taken away by the DBA, per function
--
REVOKE EXECUTE ON FUNCTION idempotency.idem_lookup(text, text) FROM PUBLIC;
SET ROLE regress_idem_app;
SELECT throws_ok($$SELECT * FROM idempotency.idem_lookup('p1', 'pgtap-priv')$$,
                 '42501', NULL, 'a revoked client function is refused');
SELECT lives_ok($$SELECT * FROM idempotency.idem_claim('p1', '{"a": 1}', 'pgtap-priv')$$,
                'the others still work');
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
