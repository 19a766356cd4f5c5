-- schema.sql (pgTAP): the objects CREATE EXTENSION idempotency makes, their
-- exact signatures, defaults, return types and properties.
-- Run with pg_prove against a database where the extension is created.
\set ON_ERROR_STOP 1
BEGIN;
CREATE EXTENSION IF NOT EXISTS pgtap;
SET LOCAL intervalstyle = 'postgres';
SELECT plan(209);

-- the extension
SELECT has_extension('idempotency', 'idempotency', 'extension idempotency lives in schema idempotency');
SELECT is((SELECT extrelocatable FROM pg_extension WHERE extname = 'idempotency'), false,
          'the extension is not relocatable');
SELECT is((SELECT extversion FROM pg_extension WHERE extname = 'idempotency'), '1.8',
          'extension version 1.8');
SELECT has_schema('idempotency');

-- the table
SELECT has_table('idempotency', 'keys', 'table idempotency.keys exists');
SELECT is((SELECT relpersistence::text FROM pg_class WHERE oid = 'idempotency.keys'::regclass), 'p',
          'keys is a permanent, WAL-logged table (not unlogged, not temporary)');
SELECT columns_are('idempotency', 'keys', ARRAY[
    'scope', 'key', 'status', 'token', 'attempt', 'fingerprint', 'response_code',
    'response_body', 'created_at', 'finished_at', 'lease_until', 'expires_at',
    'retention', 'sweep_at', 'phase', 'phase_data', 'owner_session', 'remember', 'request']);
SELECT col_type_is('idempotency'::name, 'keys'::name, 'scope'::name, 'text'::text, 'keys.scope is text');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'key'::name, 'text'::text, 'keys.key is text');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'status'::name, 'text'::text, 'keys.status is text');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'token'::name, 'bigint'::text, 'keys.token is bigint');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'attempt'::name, 'integer'::text, 'keys.attempt is integer');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'fingerprint'::name, 'bytea'::text, 'keys.fingerprint is bytea');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'response_code'::name, 'integer'::text, 'keys.response_code is integer');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'response_body'::name, 'jsonb'::text, 'keys.response_body is jsonb');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'created_at'::name, 'timestamp with time zone'::text, 'keys.created_at is timestamp with time zone');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'finished_at'::name, 'timestamp with time zone'::text, 'keys.finished_at is timestamp with time zone');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'lease_until'::name, 'timestamp with time zone'::text, 'keys.lease_until is timestamp with time zone');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'expires_at'::name, 'timestamp with time zone'::text, 'keys.expires_at is timestamp with time zone');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'retention'::name, 'interval'::text, 'keys.retention is interval');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'sweep_at'::name, 'timestamp with time zone'::text, 'keys.sweep_at is timestamp with time zone');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'phase'::name, 'text'::text, 'keys.phase is text');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'phase_data'::name, 'jsonb'::text, 'keys.phase_data is jsonb');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'owner_session'::name, 'bigint'::text, 'keys.owner_session is bigint');
SELECT col_is_null('idempotency'::name, 'keys'::name, 'phase'::name, 'keys.phase is nullable (no checkpoint)');
SELECT col_is_null('idempotency'::name, 'keys'::name, 'owner_session'::name, 'keys.owner_session is nullable (not session-bound)');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'remember'::name, 'interval'::text, 'keys.remember is interval');
SELECT col_is_null('idempotency'::name, 'keys'::name, 'remember'::name, 'keys.remember is nullable (not remembered)');
SELECT col_type_is('idempotency'::name, 'keys'::name, 'request'::name, 'jsonb'::text, 'keys.request is jsonb');
SELECT col_is_null('idempotency'::name, 'keys'::name, 'request'::name, 'keys.request is nullable (no request kept)');
SELECT is((SELECT c.collname::text FROM pg_attribute a JOIN pg_collation c ON c.oid = a.attcollation
            WHERE a.attrelid = 'idempotency.keys'::regclass AND a.attname = 'scope'),
          'C', 'scope compares byte for byte (COLLATE "C")');
SELECT is((SELECT c.collname::text FROM pg_attribute a JOIN pg_collation c ON c.oid = a.attcollation
            WHERE a.attrelid = 'idempotency.keys'::regclass AND a.attname = 'key'),
          'C', 'key compares byte for byte (COLLATE "C")');
SELECT col_not_null('idempotency'::name, 'keys'::name, 'scope'::name, 'keys.scope is NOT NULL');
SELECT col_not_null('idempotency'::name, 'keys'::name, 'key'::name, 'keys.key is NOT NULL');
SELECT col_not_null('idempotency'::name, 'keys'::name, 'status'::name, 'keys.status is NOT NULL');
SELECT col_not_null('idempotency'::name, 'keys'::name, 'attempt'::name, 'keys.attempt is NOT NULL');
SELECT col_not_null('idempotency'::name, 'keys'::name, 'created_at'::name, 'keys.created_at is NOT NULL');
SELECT col_not_null('idempotency'::name, 'keys'::name, 'expires_at'::name, 'keys.expires_at is NOT NULL');
SELECT col_not_null('idempotency'::name, 'keys'::name, 'retention'::name, 'keys.retention is NOT NULL');
SELECT col_is_null('idempotency'::name, 'keys'::name, 'token'::name, 'token is nullable (NULL after a sweeper reset)');
SELECT col_is_null('idempotency'::name, 'keys'::name, 'fingerprint'::name, 'fingerprint is nullable (no request)');
SELECT col_is_null('idempotency'::name, 'keys'::name, 'response_code'::name, 'keys.response_code is nullable');
SELECT col_is_null('idempotency'::name, 'keys'::name, 'response_body'::name, 'keys.response_body is nullable');
SELECT col_is_null('idempotency'::name, 'keys'::name, 'finished_at'::name, 'keys.finished_at is nullable');
SELECT has_pk('idempotency', 'keys', 'keys has a primary key');
SELECT col_is_pk('idempotency', 'keys', ARRAY['scope', 'key'], 'the primary key is (scope, key)');
SELECT has_index('idempotency', 'keys', 'keys_sweep_at_idx', 'sweep_at',
                 'keys_sweep_at_idx indexes sweep_at');
SELECT is((SELECT indexdef FROM pg_indexes
            WHERE schemaname = 'idempotency' AND indexname = 'keys_owner_session_idx'),
          'CREATE INDEX keys_owner_session_idx ON idempotency.keys USING btree (owner_session) WHERE (owner_session IS NOT NULL)',
          'keys_owner_session_idx indexes only the keys bound to a session');
SELECT is((SELECT indexdef FROM pg_indexes
            WHERE schemaname = 'idempotency' AND indexname = 'keys_abandoned_idx'),
          'CREATE INDEX keys_abandoned_idx ON idempotency.keys USING btree (scope, created_at) WHERE (token IS NULL)',
          'keys_abandoned_idx indexes only the keys a sweep reset, by scope and lease');
SELECT is((SELECT count(*)::int FROM pg_trigger WHERE tgrelid = 'idempotency.keys'::regclass), 0,
          'no triggers on keys');

-- the sequence
SELECT has_sequence('idempotency', 'token_seq', 'sequence idempotency.token_seq exists');
SELECT is((SELECT seqtypid::regtype::text FROM pg_sequence
            WHERE seqrelid = 'idempotency.token_seq'::regclass), 'bigint', 'token_seq is bigint');
SELECT is((SELECT seqcycle FROM pg_sequence
            WHERE seqrelid = 'idempotency.token_seq'::regclass), false, 'token_seq never cycles');
SELECT cmp_ok((SELECT seqincrement FROM pg_sequence
                WHERE seqrelid = 'idempotency.token_seq'::regclass), '>', 0::bigint,
              'token_seq increases');

-- both are extension members and dumped with their contents
SELECT set_eq($$SELECT unnest(extconfig)::regclass::text FROM pg_extension WHERE extname = 'idempotency'$$,
              ARRAY['idempotency.keys', 'idempotency.token_seq', 'idempotency.scope_bindings'],
              'keys, token_seq and scope_bindings are registered with pg_extension_config_dump');
SELECT set_eq($$SELECT unnest(extcondition) FROM pg_extension WHERE extname = 'idempotency'$$,
              ARRAY['', '', ''], 'their whole content is dumped');
SELECT set_has($$SELECT objid::regclass::text FROM pg_depend
                  WHERE refclassid = 'pg_extension'::regclass AND classid = 'pg_class'::regclass
                    AND deptype = 'e'
                    AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')$$,
               $$VALUES ('idempotency.keys'), ('idempotency.token_seq')$$,
               'keys and token_seq belong to the extension');

-- idem_claim's outcome row type: the columns in order, an extension member
SELECT has_composite('idempotency', 'claim_result', 'composite type idempotency.claim_result exists');
SELECT is((SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' ORDER BY attnum)
             FROM pg_attribute
            WHERE attrelid = 'idempotency.claim_result'::regclass AND attnum > 0 AND NOT attisdropped),
          'outcome text, token bigint, attempt integer, status text, response_code integer, response_body jsonb, retry_after integer, phase text, phase_data jsonb',
          'claim_result: outcome, token, attempt, status, response_code, response_body, retry_after, phase, phase_data');
SELECT is((SELECT count(*)::int FROM pg_depend
            WHERE classid = 'pg_type'::regclass AND objid = 'idempotency.claim_result'::regtype
              AND refclassid = 'pg_extension'::regclass AND deptype = 'e'
              AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')), 1,
          'claim_result belongs to the extension');

-- the functions: exact argument lists (names, types, defaults)
SELECT has_function('idempotency', 'idem_claim',
                    ARRAY['text', 'jsonb', 'text', 'interval', 'interval', 'interval', 'boolean', 'interval', 'boolean']);
SELECT has_function('idempotency', 'idem_finish',
                    ARRAY['text', 'bigint', 'integer', 'jsonb', 'text', 'text', 'interval', 'interval']);
SELECT has_function('idempotency', 'idem_extend', ARRAY['text', 'bigint', 'interval', 'text']);
SELECT has_function('idempotency', 'idem_release', ARRAY['text', 'bigint', 'text']);
SELECT has_function('idempotency', 'idem_lookup', ARRAY['text', 'text']);
SELECT has_function('idempotency', 'idem_sweep', ARRAY['integer']);
SELECT has_function('idempotency', 'idem_version', ARRAY[]::name[]);
SELECT has_function('idempotency', 'idem_checkpoint', ARRAY['text', 'bigint', 'text', 'jsonb', 'text']);
SELECT has_function('idempotency', 'idem_claim_many',
                    ARRAY['text[]', 'jsonb[]', 'text', 'interval', 'interval', 'boolean']);
SELECT has_function('idempotency', 'idem_finish_many',
                    ARRAY['text[]', 'bigint[]', 'integer[]', 'jsonb[]', 'text', 'text', 'interval', 'interval']);
SELECT has_function('idempotency', 'idem_forget', ARRAY['text', 'text']);
SELECT has_function('idempotency', 'idem_claim_abandoned', ARRAY['text', 'integer', 'interval']);
SELECT is((SELECT count(*)::int FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
            WHERE n.nspname = 'idempotency' AND p.proname LIKE 'idem\_%'), 12,
          'one function of each name: no overloads');
SELECT is(pg_get_function_arguments('idempotency.idem_claim(text,jsonb,text,interval,interval,interval,boolean,interval,boolean)'::regprocedure),
          'key text, request jsonb DEFAULT NULL::jsonb, scope text DEFAULT ''''::text, lease interval DEFAULT NULL::interval, retention interval DEFAULT NULL::interval, wait interval DEFAULT ''00:00:00''::interval, session_bound boolean DEFAULT false, remember interval DEFAULT NULL::interval, keep_request boolean DEFAULT false',
          'idem_claim arguments and defaults');
SELECT is(pg_get_function_arguments('idempotency.idem_finish(text,bigint,integer,jsonb,text,text,interval,interval)'::regprocedure),
          'key text, token bigint, response_code integer DEFAULT NULL::integer, response_body jsonb DEFAULT NULL::jsonb, scope text DEFAULT ''''::text, status text DEFAULT ''succeeded''::text, retention interval DEFAULT NULL::interval, remember interval DEFAULT NULL::interval',
          'idem_finish arguments and defaults');
SELECT is(pg_get_function_arguments('idempotency.idem_extend(text,bigint,interval,text)'::regprocedure),
          'key text, token bigint, lease interval DEFAULT NULL::interval, scope text DEFAULT ''''::text',
          'idem_extend arguments and defaults');
SELECT is(pg_get_function_arguments('idempotency.idem_release(text,bigint,text)'::regprocedure),
          'key text, token bigint, scope text DEFAULT ''''::text',
          'idem_release arguments and defaults');
SELECT is(pg_get_function_arguments('idempotency.idem_lookup(text,text)'::regprocedure),
          'key text, scope text DEFAULT ''''::text',
          'idem_lookup arguments and defaults');
SELECT is(pg_get_function_arguments('idempotency.idem_sweep(integer)'::regprocedure),
          'batch_size integer DEFAULT NULL::integer',
          'idem_sweep arguments and defaults');
SELECT is(pg_get_function_arguments('idempotency.idem_checkpoint(text,bigint,text,jsonb,text)'::regprocedure),
          'key text, token bigint, phase text, data jsonb DEFAULT NULL::jsonb, scope text DEFAULT ''''::text',
          'idem_checkpoint arguments and defaults');
SELECT is(pg_get_function_arguments('idempotency.idem_claim_many(text[],jsonb[],text,interval,interval,boolean)'::regprocedure),
          'keys text[], requests jsonb[] DEFAULT NULL::jsonb[], scope text DEFAULT ''''::text, lease interval DEFAULT NULL::interval, retention interval DEFAULT NULL::interval, session_bound boolean DEFAULT false',
          'idem_claim_many arguments and defaults');
SELECT is(pg_get_function_arguments('idempotency.idem_finish_many(text[],bigint[],integer[],jsonb[],text,text,interval,interval)'::regprocedure),
          'keys text[], tokens bigint[], response_codes integer[] DEFAULT NULL::integer[], response_bodies jsonb[] DEFAULT NULL::jsonb[], scope text DEFAULT ''''::text, status text DEFAULT ''succeeded''::text, retention interval DEFAULT NULL::interval, remember interval DEFAULT NULL::interval',
          'idem_finish_many arguments and defaults');
SELECT is(pg_get_function_arguments('idempotency.idem_forget(text,text)'::regprocedure),
          'key text, scope text DEFAULT ''''::text',
          'idem_forget arguments and defaults');
SELECT is(pg_get_function_arguments('idempotency.idem_claim_abandoned(text,integer,interval)'::regprocedure),
          'scope text DEFAULT ''''::text, max_keys integer DEFAULT 1, lease interval DEFAULT NULL::interval',
          'idem_claim_abandoned arguments and defaults');
SELECT function_returns('idempotency', 'idem_forget', ARRAY['text', 'text'], 'boolean');
SELECT volatility_is('idempotency', 'idem_forget', ARRAY['text', 'text'], 'volatile');
SELECT isnt_definer('idempotency', 'idem_forget', ARRAY['text', 'text']);

-- return types
SELECT is(pg_get_function_result('idempotency.idem_claim(text,jsonb,text,interval,interval,interval,boolean,interval,boolean)'::regprocedure),
          'SETOF idempotency.claim_result',
          'idem_claim returns its outcome row, of type claim_result');
SELECT function_returns('idempotency', 'idem_finish',
                        ARRAY['text', 'bigint', 'integer', 'jsonb', 'text', 'text', 'interval', 'interval'],
                        'timestamp with time zone');
SELECT function_returns('idempotency', 'idem_extend', ARRAY['text', 'bigint', 'interval', 'text'],
                        'timestamp with time zone');
SELECT function_returns('idempotency', 'idem_release', ARRAY['text', 'bigint', 'text'], 'void');
SELECT is(pg_get_function_result('idempotency.idem_lookup(text,text)'::regprocedure),
          'TABLE(status text, attempt integer, response_code integer, response_body jsonb, created_at timestamp with time zone, finished_at timestamp with time zone, expires_at timestamp with time zone, phase text, remembered_until timestamp with time zone)',
          'idem_lookup returns the key''s state');
SELECT is(pg_get_function_result('idempotency.idem_sweep(integer)'::regprocedure),
          'TABLE(expired bigint, reset bigint)',
          'idem_sweep returns (expired, reset)');
SELECT function_returns('idempotency', 'idem_version', ARRAY[]::name[], 'text');
SELECT function_returns('idempotency', 'idem_checkpoint', ARRAY['text', 'bigint', 'text', 'jsonb', 'text'], 'void');
SELECT is(pg_get_function_result('idempotency.idem_claim_many(text[],jsonb[],text,interval,interval,boolean)'::regprocedure),
          'TABLE(ord integer, key text, outcome text, token bigint, attempt integer, status text, response_code integer, response_body jsonb, retry_after integer, phase text, phase_data jsonb)',
          'idem_claim_many returns one numbered outcome row per key');
SELECT is(pg_get_function_result('idempotency.idem_finish_many(text[],bigint[],integer[],jsonb[],text,text,interval,interval)'::regprocedure),
          'TABLE(ord integer, key text, expires_at timestamp with time zone)',
          'idem_finish_many returns one numbered expiry per key');
SELECT is(pg_get_function_result('idempotency.idem_claim_abandoned(text,integer,interval)'::regprocedure),
          'TABLE(key text, token bigint, attempt integer, request jsonb, phase text, phase_data jsonb)',
          'idem_claim_abandoned returns one row per key taken over');
SELECT function_lang_is('idempotency', 'idem_claim_abandoned', ARRAY['text', 'integer', 'interval'], 'c');
SELECT isnt_definer('idempotency', 'idem_claim_abandoned', ARRAY['text', 'integer', 'interval']);
SELECT isnt_strict('idempotency', 'idem_claim_abandoned', ARRAY['text', 'integer', 'interval']);
SELECT volatility_is('idempotency', 'idem_claim_abandoned', ARRAY['text', 'integer', 'interval'], 'volatile');
SELECT function_lang_is('idempotency', 'idem_checkpoint', ARRAY['text', 'bigint', 'text', 'jsonb', 'text'], 'c');
SELECT function_lang_is('idempotency', 'idem_claim_many', ARRAY['text[]', 'jsonb[]', 'text', 'interval', 'interval', 'boolean'], 'c');
SELECT function_lang_is('idempotency', 'idem_finish_many', ARRAY['text[]', 'bigint[]', 'integer[]', 'jsonb[]', 'text', 'text', 'interval', 'interval'], 'c');
SELECT isnt_definer('idempotency', 'idem_checkpoint', ARRAY['text', 'bigint', 'text', 'jsonb', 'text']);
SELECT isnt_definer('idempotency', 'idem_claim_many', ARRAY['text[]', 'jsonb[]', 'text', 'interval', 'interval', 'boolean']);
SELECT isnt_definer('idempotency', 'idem_finish_many', ARRAY['text[]', 'bigint[]', 'integer[]', 'jsonb[]', 'text', 'text', 'interval', 'interval']);
SELECT isnt_strict('idempotency', 'idem_checkpoint', ARRAY['text', 'bigint', 'text', 'jsonb', 'text']);
SELECT isnt_strict('idempotency', 'idem_claim_many', ARRAY['text[]', 'jsonb[]', 'text', 'interval', 'interval', 'boolean']);
SELECT isnt_strict('idempotency', 'idem_finish_many', ARRAY['text[]', 'bigint[]', 'integer[]', 'jsonb[]', 'text', 'text', 'interval', 'interval']);
SELECT volatility_is('idempotency', 'idem_checkpoint', ARRAY['text', 'bigint', 'text', 'jsonb', 'text'], 'volatile');
SELECT volatility_is('idempotency', 'idem_claim_many', ARRAY['text[]', 'jsonb[]', 'text', 'interval', 'interval', 'boolean'], 'volatile');
SELECT volatility_is('idempotency', 'idem_finish_many', ARRAY['text[]', 'bigint[]', 'integer[]', 'jsonb[]', 'text', 'text', 'interval', 'interval'], 'volatile');

-- properties: C, not SECURITY DEFINER, not STRICT (NULL arguments raise
-- 22004 rather than silently returning nothing), volatility, parallel
SELECT function_lang_is('idempotency', 'idem_claim', ARRAY['text', 'jsonb', 'text', 'interval', 'interval', 'interval', 'boolean', 'interval', 'boolean'], 'c');
SELECT function_lang_is('idempotency', 'idem_finish', ARRAY['text', 'bigint', 'integer', 'jsonb', 'text', 'text', 'interval', 'interval'], 'c');
SELECT function_lang_is('idempotency', 'idem_extend', ARRAY['text', 'bigint', 'interval', 'text'], 'c');
SELECT function_lang_is('idempotency', 'idem_release', ARRAY['text', 'bigint', 'text'], 'c');
SELECT function_lang_is('idempotency', 'idem_lookup', ARRAY['text', 'text'], 'c');
SELECT function_lang_is('idempotency', 'idem_sweep', ARRAY['integer'], 'c');
SELECT function_lang_is('idempotency', 'idem_version', ARRAY[]::name[], 'c');
SELECT isnt_definer('idempotency', 'idem_claim', ARRAY['text', 'jsonb', 'text', 'interval', 'interval', 'interval', 'boolean', 'interval', 'boolean']);
SELECT isnt_definer('idempotency', 'idem_finish', ARRAY['text', 'bigint', 'integer', 'jsonb', 'text', 'text', 'interval', 'interval']);
SELECT isnt_definer('idempotency', 'idem_extend', ARRAY['text', 'bigint', 'interval', 'text']);
SELECT isnt_definer('idempotency', 'idem_release', ARRAY['text', 'bigint', 'text']);
SELECT isnt_definer('idempotency', 'idem_lookup', ARRAY['text', 'text']);
SELECT isnt_definer('idempotency', 'idem_sweep', ARRAY['integer']);
SELECT isnt_definer('idempotency', 'idem_version', ARRAY[]::name[]);
SELECT isnt_strict('idempotency', 'idem_claim', ARRAY['text', 'jsonb', 'text', 'interval', 'interval', 'interval', 'boolean', 'interval', 'boolean']);
SELECT isnt_strict('idempotency', 'idem_finish', ARRAY['text', 'bigint', 'integer', 'jsonb', 'text', 'text', 'interval', 'interval']);
SELECT isnt_strict('idempotency', 'idem_extend', ARRAY['text', 'bigint', 'interval', 'text']);
SELECT isnt_strict('idempotency', 'idem_release', ARRAY['text', 'bigint', 'text']);
SELECT isnt_strict('idempotency', 'idem_lookup', ARRAY['text', 'text']);
SELECT isnt_strict('idempotency', 'idem_sweep', ARRAY['integer']);
SELECT volatility_is('idempotency', 'idem_claim', ARRAY['text', 'jsonb', 'text', 'interval', 'interval', 'interval', 'boolean', 'interval', 'boolean'], 'volatile');
SELECT volatility_is('idempotency', 'idem_finish', ARRAY['text', 'bigint', 'integer', 'jsonb', 'text', 'text', 'interval', 'interval'], 'volatile');
SELECT volatility_is('idempotency', 'idem_extend', ARRAY['text', 'bigint', 'interval', 'text'], 'volatile');
SELECT volatility_is('idempotency', 'idem_release', ARRAY['text', 'bigint', 'text'], 'volatile');
SELECT volatility_is('idempotency', 'idem_sweep', ARRAY['integer'], 'volatile');
SELECT volatility_is('idempotency', 'idem_lookup', ARRAY['text', 'text'], 'stable');
SELECT volatility_is('idempotency', 'idem_version', ARRAY[]::name[], 'stable');
SELECT is((SELECT array_agg(p.proname::text || ':' || p.proparallel::text ORDER BY p.proname)
             FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
            WHERE n.nspname = 'idempotency' AND p.proname LIKE 'idem\_%'),
          ARRAY['idem_checkpoint:u', 'idem_claim:u', 'idem_claim_abandoned:u', 'idem_claim_many:u', 'idem_extend:u',
                'idem_finish:u', 'idem_finish_many:u', 'idem_forget:u', 'idem_lookup:r',
                'idem_release:u', 'idem_sweep:u', 'idem_version:s'],
          'writers are PARALLEL UNSAFE, lookup PARALLEL RESTRICTED, idem_version PARALLEL SAFE');
SELECT is((SELECT array_agg(p.proname::text ORDER BY p.proname)
             FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
            WHERE n.nspname = 'idempotency' AND p.proname LIKE 'idem\_%' AND p.proretset),
          ARRAY['idem_claim', 'idem_claim_abandoned', 'idem_claim_many', 'idem_finish_many', 'idem_lookup',
                'idem_sweep'],
          'claim, the completers'' claim, the batches, lookup and sweep return rows');
SELECT is((SELECT array_agg(DISTINCT p.probin) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
            WHERE n.nspname = 'idempotency' AND p.proname LIKE 'idem\_%'),
          ARRAY['$libdir/idempotency'], 'all functions live in $libdir/idempotency');
SELECT is((SELECT array_agg(p.prosrc ORDER BY p.prosrc) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
            WHERE n.nspname = 'idempotency' AND p.proname LIKE 'idem\_%'),
          ARRAY['idem_checkpoint', 'idem_claim', 'idem_claim_abandoned', 'idem_claim_many', 'idem_extend', 'idem_finish',
                'idem_finish_many', 'idem_forget', 'idem_lookup', 'idem_release', 'idem_sweep',
                'idem_version'],
          'each function has the C symbol of its name');

-- the stats view, the operations functions and the tenant bindings
SELECT has_view('idempotency', 'stats', 'view idempotency.stats exists');
SELECT columns_are('idempotency', 'stats', ARRAY[
    'database', 'claims', 'takeovers', 'replays', 'in_progress', 'mismatches', 'finishes',
    'releases', 'expired', 'reset', 'last_sweep_at', 'last_sweep_ms',
    'pending', 'succeeded', 'failed', 'key_counts_exact', 'checkpoints', 'remembered',
    'abandoned_takeovers']);
SELECT col_type_is('idempotency'::name, 'stats'::name, 'key_counts_exact'::name, 'boolean'::text,
                   'stats.key_counts_exact is boolean');
SELECT has_function('idempotency', 'stats_key_counts', ARRAY[]::name[]);
SELECT function_returns('idempotency', 'stats_key_counts', ARRAY[]::name[], 'record');
SELECT function_lang_is('idempotency', 'stats_key_counts', ARRAY[]::name[], 'c');
SELECT isnt_definer('idempotency', 'stats_key_counts', ARRAY[]::name[]);
SELECT is((SELECT pg_get_function_result('idempotency.stats_key_counts()'::regprocedure)),
          'record', 'stats_key_counts() returns one record');
SELECT has_function('idempotency', 'stats_reset', ARRAY[]::name[]);
SELECT function_returns('idempotency', 'stats_reset', ARRAY[]::name[], 'void');
SELECT isnt_definer('idempotency', 'stats_reset', ARRAY[]::name[]);
SELECT has_table('idempotency', 'scope_bindings', 'table idempotency.scope_bindings exists');
SELECT columns_are('idempotency', 'scope_bindings', ARRAY['role', 'scope_prefix']);
SELECT col_is_pk('idempotency', 'scope_bindings', ARRAY['role'], 'one binding per role');
SELECT col_type_is('idempotency'::name, 'scope_bindings'::name, 'role'::name, 'regrole'::text,
                   'scope_bindings.role is regrole');
SELECT has_trigger('idempotency', 'scope_bindings', 'scope_bindings_changed',
                   'changes to the bindings are broadcast');
SELECT has_function('idempotency', 'bind_scope', ARRAY['regrole', 'text']);
SELECT function_returns('idempotency', 'bind_scope', ARRAY['regrole', 'text'], 'void');
SELECT isnt_definer('idempotency', 'bind_scope', ARRAY['regrole', 'text']);
SELECT has_function('idempotency', 'unbind_scope', ARRAY['regrole']);
SELECT function_returns('idempotency', 'unbind_scope', ARRAY['regrole'], 'boolean');
SELECT isnt_definer('idempotency', 'unbind_scope', ARRAY['regrole']);
-- a plain DELETE in PL/pgSQL (Citus cannot plan a DELETE inside a WITH on a
-- reference table), STRICT as before
SELECT function_lang_is('idempotency', 'unbind_scope', ARRAY['regrole'], 'plpgsql');
SELECT is_strict('idempotency', 'unbind_scope', ARRAY['regrole']);
SELECT volatility_is('idempotency', 'unbind_scope', ARRAY['regrole'], 'volatile');

-- Citus: distribute() and the cluster_stats view
SELECT has_function('idempotency', 'distribute', ARRAY['integer']);
SELECT is(pg_get_function_arguments('idempotency.distribute(integer)'::regprocedure),
          'shard_count integer DEFAULT NULL::integer', 'distribute arguments and defaults');
SELECT function_returns('idempotency', 'distribute', ARRAY['integer'], 'void');
SELECT function_lang_is('idempotency', 'distribute', ARRAY['integer'], 'plpgsql');
SELECT volatility_is('idempotency', 'distribute', ARRAY['integer'], 'volatile');
SELECT isnt_definer('idempotency', 'distribute', ARRAY['integer']);
SELECT isnt_strict('idempotency', 'distribute', ARRAY['integer']);
SELECT has_function('idempotency', 'cluster_stats_rows', ARRAY[]::name[]);
SELECT is(pg_get_function_result('idempotency.cluster_stats_rows()'::regprocedure),
          'TABLE(node text, database name, claims bigint, takeovers bigint, replays bigint, in_progress bigint, mismatches bigint, finishes bigint, releases bigint, expired bigint, reset bigint, last_sweep_at timestamp with time zone, last_sweep_ms double precision, pending bigint, succeeded bigint, failed bigint, key_counts_exact boolean, checkpoints bigint, remembered bigint, abandoned_takeovers bigint)',
          'cluster_stats_rows returns one row per node: the node, then the stats columns');
SELECT function_lang_is('idempotency', 'cluster_stats_rows', ARRAY[]::name[], 'plpgsql');
SELECT volatility_is('idempotency', 'cluster_stats_rows', ARRAY[]::name[], 'stable');
SELECT isnt_definer('idempotency', 'cluster_stats_rows', ARRAY[]::name[]);
SELECT has_function('idempotency', 'cluster_stats_failed', ARRAY['text', 'integer', 'text']);
SELECT function_returns('idempotency', 'cluster_stats_failed', ARRAY['text', 'integer', 'text'], 'json');
SELECT function_lang_is('idempotency', 'cluster_stats_failed', ARRAY['text', 'integer', 'text'], 'plpgsql');
SELECT isnt_definer('idempotency', 'cluster_stats_failed', ARRAY['text', 'integer', 'text']);
SELECT is((SELECT array_agg(p.proname::text || ':' || array_to_string(p.proconfig, ';') ORDER BY p.proname)
             FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
            WHERE n.nspname = 'idempotency'
              AND p.prolang <> (SELECT oid FROM pg_language WHERE lanname = 'c')),
          ARRAY['bind_scope:search_path=pg_catalog, pg_temp',
                'cluster_stats_failed:search_path=pg_catalog, pg_temp',
                'cluster_stats_rows:search_path=pg_catalog, pg_temp',
                'distribute:search_path=pg_catalog, pg_temp',
                'unbind_scope:search_path=pg_catalog, pg_temp'],
          'every SQL and PL/pgSQL function runs with search_path pg_catalog, pg_temp');
SELECT has_view('idempotency', 'cluster_stats', 'view idempotency.cluster_stats exists');
SELECT views_are('idempotency', ARRAY['stats', 'cluster_stats'], 'the two views');
SELECT is((SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' ORDER BY attnum)
             FROM pg_attribute WHERE attrelid = 'idempotency.cluster_stats'::regclass AND attnum > 0),
          'node text, ' || (SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' ORDER BY attnum)
                              FROM pg_attribute WHERE attrelid = 'idempotency.stats'::regclass AND attnum > 0),
          'cluster_stats: node, then the columns of stats with their types, in order');
SELECT set_eq($$SELECT p.oid::regprocedure::text FROM pg_depend d JOIN pg_proc p ON p.oid = d.objid
                 WHERE d.classid = 'pg_proc'::regclass AND d.deptype = 'e'
                   AND d.refclassid = 'pg_extension'::regclass
                   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')$$,
              ARRAY['idempotency.bind_scope(regrole,text)',
                    'idempotency.cluster_stats_failed(text,integer,text)',
                    'idempotency.cluster_stats_rows()',
                    'idempotency.distribute(integer)',
                    'idempotency.idem_checkpoint(text,bigint,text,jsonb,text)',
                    'idempotency.idem_claim(text,jsonb,text,interval,interval,interval,boolean,interval,boolean)',
                    'idempotency.idem_claim_abandoned(text,integer,interval)',
                    'idempotency.idem_claim_many(text[],jsonb[],text,interval,interval,boolean)',
                    'idempotency.idem_extend(text,bigint,interval,text)',
                    'idempotency.idem_finish(text,bigint,integer,jsonb,text,text,interval,interval)',
                    'idempotency.idem_finish_many(text[],bigint[],integer[],jsonb[],text,text,interval,interval)',
                    'idempotency.idem_forget(text,text)',
                    'idempotency.idem_lookup(text,text)',
                    'idempotency.idem_release(text,bigint,text)',
                    'idempotency.idem_sweep(integer)',
                    'idempotency.idem_version()',
                    'idempotency.scope_bindings_changed()',
                    'idempotency.stats_counters()',
                    'idempotency.stats_key_counts()',
                    'idempotency.stats_reset()',
                    'idempotency.unbind_scope(regrole)'],
              'the extension''s functions, each with its signature, and no other');

-- they work: one round trip
SELECT is((SELECT outcome FROM idempotency.idem_claim('schema-1', '{"a": 1}', 'pgtap-schema')), 'claimed',
          'idem_claim claims a new key');
SELECT is((SELECT outcome FROM idempotency.idem_claim('schema-1', '{"a": 1}', 'pgtap-schema')), 'in_progress',
          'idem_claim of a key this transaction holds answers in_progress');
SELECT cmp_ok(idempotency.idem_finish('schema-1', (SELECT token FROM idempotency.keys
                                                     WHERE scope = 'pgtap-schema' AND key = 'schema-1'),
                                      200, '{"r": 1}', 'pgtap-schema'),
              '>', now(), 'idem_finish returns a future expiry');
SELECT results_eq($$SELECT outcome, response_code, response_body
                      FROM idempotency.idem_claim('schema-1', '{"a": 1}', 'pgtap-schema')$$,
                  $$VALUES ('replay'::text, 200, '{"r": 1}'::jsonb)$$,
                  'a finished key replays');
SELECT results_eq($$SELECT status, attempt, response_code FROM idempotency.idem_lookup('schema-1', 'pgtap-schema')$$,
                  $$VALUES ('succeeded'::text, 1, 200)$$, 'idem_lookup shows it');
CREATE TEMP TABLE claims (c idempotency.claim_result);
INSERT INTO claims SELECT c FROM idempotency.idem_claim('schema-1', '{"a": 1}', 'pgtap-schema') AS c;
SELECT results_eq($$SELECT (c).outcome, (c).response_code FROM claims$$,
                  $$VALUES ('replay'::text, 200)$$,
                  'a column of type claim_result stores an outcome row');
DO $$
DECLARE
    r idempotency.claim_result;
BEGIN
    SELECT * INTO r FROM idempotency.idem_claim('schema-1', '{"a": 2}', 'pgtap-schema');
    CREATE TEMP TABLE declared AS SELECT r.outcome;
END
$$;
SELECT is((SELECT outcome FROM declared), 'mismatch', 'a variable of type claim_result holds an outcome row');
-- without Citus: distribute() refuses, cluster_stats shows this server
SELECT throws_ok('SELECT idempotency.distribute()', '55000',
                 'extension "citus" is not installed in this database',
                 'distribute() without Citus raises 55000');
SELECT results_eq($$SELECT node, database FROM idempotency.cluster_stats$$,
                  $$VALUES ('local'::text, current_database())$$,
                  'cluster_stats without Citus: one row, node local, this database');
SELECT is(idempotency.idem_version(), '1.8.2', 'idem_version() names the loaded library, 1.8.2');

-- the settings exist with their contexts
SELECT set_eq($$SELECT name || ':' || context FROM pg_settings WHERE name LIKE 'idempotency.%'$$,
              ARRAY['idempotency.lease:user', 'idempotency.retention:user', 'idempotency.remember:user',
                    'idempotency.max_response_size:superuser', 'idempotency.sweep_batch:sighup',
                    'idempotency.sweep_interval:sighup', 'idempotency.stats_exact_limit:superuser'],
              'the seven settings and their contexts');
SELECT is(current_setting('idempotency.lease'), '30s', 'lease defaults to 30s');
SELECT is(current_setting('idempotency.retention'), '1d', 'retention defaults to 24h');
SELECT is(current_setting('idempotency.remember'), '0', 'remember defaults to 0 (off)');
SELECT is(current_setting('idempotency.max_response_size'), '1MB', 'max_response_size defaults to 1MB');
SELECT is((SELECT boot_val FROM pg_settings WHERE name = 'idempotency.sweep_batch'), '1000',
          'sweep_batch defaults to 1000');
SELECT is((SELECT boot_val || unit FROM pg_settings WHERE name = 'idempotency.sweep_interval'), '60000ms',
          'sweep_interval defaults to 60s');
SELECT is(current_setting('idempotency.stats_exact_limit'), '8MB', 'stats_exact_limit defaults to 8MB');

SELECT * FROM finish();
ROLLBACK;
