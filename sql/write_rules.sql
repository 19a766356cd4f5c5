--
-- write_rules.sql: every write rule of write.c (write_rules) stores the same
-- rows whether it runs through the direct table-AM writer (the table as the
-- extension made it) or through the SQL statement built from the same rule
-- (a row trigger, a rule or row security on idempotency.keys): the claim's
-- insert, the claim's update (a fresh claim over a row past its retention,
-- and a takeover), finish, extend, release, and the sweep's delete, reset
-- and reschedule.  writes.sql compares claim, extend and finish; this adds
-- release and the sweep's three writes.
--
-- One procedure (pg_temp.run_rules) plays the same life of eight keys in a
-- scope of its own for each path, committing between the steps (a sweep
-- never touches a pending key that its own transaction wrote), and takes a
-- snapshot of the stored rows before the sweep, after it and after the
-- takeover: tokens and created_at as ranks, every other timestamp as whole
-- minutes from the moment of the snapshot, and sweep_at also named by what
-- it equals.  On the trigger and rule paths a log shows every write, the
-- trigger's with the columns each UPDATE changed.
--
-- The sweep counts are exact only while nobody else sweeps this database:
-- run with the background sweeper off (idempotency.sweep_interval = 0, as
-- ./run test does).
--
\set VERBOSITY sqlstate

-- start from a clean slate: whatever expired earlier in this database, and
-- nothing else of other tests falls due while this one runs
SELECT count(*) AS calls FROM idempotency.idem_sweep(NULL);
SELECT count(*) AS due_soon FROM idempotency.keys
 WHERE sweep_at <= now() + interval '10 minutes';

CREATE TABLE wr_snap (scope text, stage text, key text, status text, token bigint,
	attempt int, has_fingerprint boolean, response_code int, response_body jsonb,
	created_at timestamptz, finished boolean, lease_min numeric, lease_live boolean,
	expires_min numeric, sweep_min numeric, sweep_is text);
CREATE TABLE wr_sweeps (scope text, stage text, expired bigint, reset bigint);
CREATE TABLE wr_log (n serial, scope text, stage text, op text, key text,
	status text, attempt int, changed text);
-- the table's triggers and rules write here with its owner's rights
DO $$ BEGIN EXECUTE format('GRANT SELECT, INSERT ON wr_log TO %1$s; GRANT USAGE ON SEQUENCE wr_log_n_seq TO %1$s', (SELECT c.relowner::regrole FROM pg_class c
    WHERE c.oid = 'idempotency.keys'::regclass)); END $$;

-- the stored rows of a scope now
CREATE FUNCTION pg_temp.snap(p_scope text, p_stage text) RETURNS void
LANGUAGE sql AS $$
	INSERT INTO wr_snap
	SELECT p_scope, p_stage, k.key, k.status, k.token, k.attempt,
	       k.fingerprint IS NOT NULL, k.response_code, k.response_body,
	       k.created_at, k.finished_at IS NOT NULL,
	       round(extract(epoch FROM k.lease_until - c.t) / 60),
	       k.lease_until > c.t,
	       round(extract(epoch FROM k.expires_at - c.t) / 60),
	       round(extract(epoch FROM k.sweep_at - c.t) / 60),
	       CASE WHEN k.sweep_at = k.expires_at THEN 'expires_at'
	            WHEN k.sweep_at = k.lease_until THEN 'lease_until'
	            WHEN k.sweep_at <= c.t THEN 'past'
	            ELSE 'future' END
	  FROM idempotency.keys k, (SELECT clock_timestamp() AS t) c
	 WHERE k.scope = p_scope
$$;

-- a scope's snapshots as shown: tokens and created_at as ranks within the scope
CREATE FUNCTION pg_temp.shown(p_scope text)
RETURNS TABLE (stage text, key text, status text, token_rank bigint, attempt int,
               has_fp boolean, code int, body jsonb, created_rank bigint,
               finished boolean, lease_min numeric, lease_live boolean,
               expires_min numeric, sweep_min numeric, sweep_is text)
LANGUAGE sql AS $$
	SELECT s.stage, s.key, s.status,
	       CASE WHEN s.token IS NOT NULL THEN
	           (SELECT count(DISTINCT t.token) FROM wr_snap t
	             WHERE t.scope = s.scope AND t.token <= s.token) END,
	       s.attempt, s.has_fingerprint, s.response_code, s.response_body,
	       (SELECT count(DISTINCT t.created_at) FROM wr_snap t
	         WHERE t.scope = s.scope AND t.created_at <= s.created_at),
	       s.finished, s.lease_min, s.lease_live, s.expires_min, s.sweep_min,
	       s.sweep_is
	  FROM wr_snap s WHERE s.scope = p_scope
$$;

-- The life of the keys, the same on every path.  Stage names go into the
-- logs through the setting wr.stage.
CREATE PROCEDURE pg_temp.run_rules(p_scope text)
LANGUAGE plpgsql AS $$
DECLARE
	t bigint;
BEGIN
	PERFORM set_config('wr.stage', 'setup', false);
	-- rel: claimed, then released: the row goes
	SELECT c.token INTO t FROM idempotency.idem_claim('rel', '{"k": "rel"}', p_scope,
		lease => '1 hour', retention => '1 hour') c;
	PERFORM idempotency.idem_release('rel', t, p_scope);
	-- exp: finished, retention 1 ms: the sweep deletes it
	SELECT c.token INTO t FROM idempotency.idem_claim('exp', '{"k": "exp"}', p_scope,
		lease => '1 hour', retention => '1 hour') c;
	PERFORM idempotency.idem_finish('exp', t, 200, '{"r": "exp"}', p_scope,
		retention => '1 millisecond');
	-- exp-pend: pending, lease and retention 1 ms: deleted, not reset
	PERFORM idempotency.idem_claim('exp-pend', NULL, p_scope,
		lease => '1 millisecond', retention => '1 millisecond');
	-- reset: pending, lease 1 ms, retention 1 hour: the sweep resets it
	PERFORM idempotency.idem_claim('reset', '{"k": "reset"}', p_scope,
		lease => '1 millisecond', retention => '1 hour');
	-- early-fin: lease 1 ms, then finished with retention 1 hour: the finish
	-- keeps sweep_at at the lease's end, the sweep moves it to expires_at
	SELECT c.token INTO t FROM idempotency.idem_claim('early-fin', '{"k": "early-fin"}',
		p_scope, lease => '1 millisecond', retention => '2 hours') c;
	PERFORM idempotency.idem_finish('early-fin', t, 409, NULL, p_scope, 'failed', '1 hour');
	-- early-pend: lease 1 ms, extended by 30 minutes: the extend keeps
	-- sweep_at at the first lease's end, the sweep moves it to lease_until
	SELECT c.token INTO t FROM idempotency.idem_claim('early-pend', NULL, p_scope,
		lease => '1 millisecond', retention => '1 hour') c;
	PERFORM idempotency.idem_extend('early-pend', t, '30 minutes', p_scope);
	-- fresh: finished with retention 1 ms, claimed afresh below
	SELECT c.token INTO t FROM idempotency.idem_claim('fresh', '{"k": "fresh"}', p_scope,
		lease => '1 hour', retention => '1 hour') c;
	PERFORM idempotency.idem_finish('fresh', t, 200, '{"r": "fresh"}', p_scope,
		retention => '1 millisecond');
	-- idle: finished, nothing due for an hour: the sweep leaves it alone
	SELECT c.token INTO t FROM idempotency.idem_claim('idle', '{"k": "idle"}', p_scope,
		lease => '1 hour', retention => '1 hour') c;
	PERFORM idempotency.idem_finish('idle', t, 200, '{"r": "idle"}', p_scope,
		retention => '3 hours');
	COMMIT;
	-- every 1 ms deadline above passes
	PERFORM pg_sleep(0.01);
	-- fresh, past its retention: a claim with another request starts afresh
	-- (attempt 1) and keeps the row's earlier sweep_at, which has passed
	PERFORM set_config('wr.stage', 'fresh claim', false);
	PERFORM idempotency.idem_claim('fresh', '{"k": "fresh-2"}', p_scope,
		lease => '1 hour', retention => '2 hours');
	COMMIT;
	PERFORM pg_temp.snap(p_scope, '1 before sweep');

	PERFORM set_config('wr.stage', 'sweep', false);
	INSERT INTO wr_sweeps SELECT p_scope, 'sweep', s.* FROM idempotency.idem_sweep() s;
	COMMIT;
	-- nothing is due any more
	PERFORM set_config('wr.stage', 'sweep again', false);
	INSERT INTO wr_sweeps SELECT p_scope, 'sweep again', s.* FROM idempotency.idem_sweep() s;
	COMMIT;
	PERFORM pg_temp.snap(p_scope, '2 after sweep');

	-- the reset key: the next matching claim takes it over (attempt 2)
	PERFORM set_config('wr.stage', 'takeover', false);
	PERFORM idempotency.idem_claim('reset', '{"k": "reset"}', p_scope,
		lease => '1 hour', retention => '3 hours');
	COMMIT;
	PERFORM pg_temp.snap(p_scope, '3 after takeover');
	PERFORM set_config('wr.stage', '', false);
END $$;

-- the table as the extension made it: direct writes
CALL pg_temp.run_rules('wr-direct');
SELECT * FROM pg_temp.shown('wr-direct') ORDER BY stage, key;
SELECT stage, expired, reset FROM wr_sweeps WHERE scope = 'wr-direct' ORDER BY stage;

-- with a row trigger: statements, and the trigger sees every write, with
-- the columns that each update changed
CREATE FUNCTION wr_log_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF TG_OP = 'DELETE' THEN
		INSERT INTO public.wr_log (scope, stage, op, key, status, attempt)
		VALUES (OLD.scope, current_setting('wr.stage'), TG_OP, OLD.key, OLD.status, OLD.attempt);
	ELSE
		INSERT INTO public.wr_log (scope, stage, op, key, status, attempt, changed)
		VALUES (NEW.scope, current_setting('wr.stage'), TG_OP, NEW.key, NEW.status, NEW.attempt,
		        CASE WHEN TG_OP = 'UPDATE' THEN
		            (SELECT string_agg(n.key, ' ' ORDER BY n.key)
		               FROM jsonb_each(to_jsonb(NEW)) n
		               JOIN jsonb_each(to_jsonb(OLD)) o ON o.key = n.key
		              WHERE n.value IS DISTINCT FROM o.value) END);
	END IF;
	RETURN NULL;
END $$;
CREATE TRIGGER wr_log_row AFTER INSERT OR UPDATE OR DELETE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION wr_log_row();
CALL pg_temp.run_rules('wr-trigger');
DROP TRIGGER wr_log_row ON idempotency.keys;
SELECT * FROM pg_temp.shown('wr-trigger') ORDER BY stage, key;
SELECT stage, expired, reset FROM wr_sweeps WHERE scope = 'wr-trigger' ORDER BY stage;
-- in log order, except inside one statement of a sweep, whose rows come in
-- the heap's order: there by operation and key
SELECT stage, op, key, status, attempt, changed FROM wr_log WHERE scope = 'wr-trigger'
 ORDER BY min(n) OVER (PARTITION BY stage), CASE WHEN stage LIKE 'sweep%' THEN op END,
		  CASE WHEN stage LIKE 'sweep%' THEN key END, n;

-- with rules: statements, and the rules fire
CREATE RULE wr_log_insert AS ON INSERT TO idempotency.keys DO ALSO
	INSERT INTO wr_log (scope, stage, op, key, status, attempt)
	VALUES (NEW.scope, current_setting('wr.stage'), 'rule insert', NEW.key, NEW.status, NEW.attempt);
CREATE RULE wr_log_update AS ON UPDATE TO idempotency.keys DO ALSO
	INSERT INTO wr_log (scope, stage, op, key, status, attempt)
	VALUES (NEW.scope, current_setting('wr.stage'), 'rule update', NEW.key, NEW.status, NEW.attempt);
CREATE RULE wr_log_delete AS ON DELETE TO idempotency.keys DO ALSO
	INSERT INTO wr_log (scope, stage, op, key, status, attempt)
	VALUES (OLD.scope, current_setting('wr.stage'), 'rule delete', OLD.key, OLD.status, OLD.attempt);
CALL pg_temp.run_rules('wr-rule');
DROP RULE wr_log_insert ON idempotency.keys;
DROP RULE wr_log_update ON idempotency.keys;
DROP RULE wr_log_delete ON idempotency.keys;
SELECT * FROM pg_temp.shown('wr-rule') ORDER BY stage, key;
SELECT stage, expired, reset FROM wr_sweeps WHERE scope = 'wr-rule' ORDER BY stage;
SELECT stage, op, key, status, attempt FROM wr_log WHERE scope = 'wr-rule'
 ORDER BY min(n) OVER (PARTITION BY stage), CASE WHEN stage LIKE 'sweep%' THEN op END,
		  CASE WHEN stage LIKE 'sweep%' THEN key END, n;

-- with row security enabled (the owner is exempt): statements
ALTER TABLE idempotency.keys ENABLE ROW LEVEL SECURITY;
CALL pg_temp.run_rules('wr-rls');
ALTER TABLE idempotency.keys DISABLE ROW LEVEL SECURITY;
SELECT * FROM pg_temp.shown('wr-rls') ORDER BY stage, key;
SELECT stage, expired, reset FROM wr_sweeps WHERE scope = 'wr-rls' ORDER BY stage;

-- every path stored what the direct path stored, at every stage: no row
-- of one is missing from the other
SELECT p.scope, count(d.stage) AS differing_rows
  FROM unnest(ARRAY['wr-trigger', 'wr-rule', 'wr-rls']) AS p(scope)
  LEFT JOIN LATERAL ((SELECT * FROM pg_temp.shown(p.scope)
                      EXCEPT ALL SELECT * FROM pg_temp.shown('wr-direct'))
                     UNION ALL
                     (SELECT * FROM pg_temp.shown('wr-direct')
                      EXCEPT ALL SELECT * FROM pg_temp.shown(p.scope))) d ON true
 GROUP BY p.scope ORDER BY p.scope;
-- the direct path wrote through no trigger or rule
SELECT count(*) AS direct_logged FROM wr_log WHERE scope = 'wr-direct';

-- A row the statement does not write (here a BEFORE trigger cancels it):
-- the sweep's rules skip it and do not count it; every other rule raises
-- 40001 and changes nothing.
SELECT outcome, token AS rel_token FROM idempotency.idem_claim('c-rel', NULL, 'wr-cancel',
       lease => '1 hour', retention => '1 hour') \gset
SELECT outcome, token AS exp_token FROM idempotency.idem_claim('c-exp', NULL, 'wr-cancel',
       lease => '1 hour', retention => '1 hour') \gset
SELECT idempotency.idem_finish('c-exp', :exp_token, 200, NULL, 'wr-cancel',
       retention => '1 millisecond') IS NOT NULL AS finished;
SELECT outcome FROM idempotency.idem_claim('c-reset', NULL, 'wr-cancel',
       lease => '1 millisecond', retention => '1 hour');
SELECT pg_sleep(0.01);
CREATE FUNCTION wr_cancel_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF OLD.scope = 'wr-cancel' THEN
		RETURN NULL;
	END IF;
	RETURN CASE TG_OP WHEN 'DELETE' THEN OLD ELSE NEW END;
END $$;
CREATE TRIGGER wr_cancel_row BEFORE UPDATE OR DELETE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION wr_cancel_row();
SELECT string_agg(k::text, '') AS cancel_rows FROM (SELECT * FROM idempotency.keys
 WHERE scope = 'wr-cancel' ORDER BY key) k \gset
SELECT idempotency.idem_release('c-rel', :rel_token, 'wr-cancel');
SELECT idempotency.idem_extend('c-rel', :rel_token, '2 hours', 'wr-cancel');
SELECT idempotency.idem_finish('c-rel', :rel_token, 200, NULL, 'wr-cancel');
SELECT * FROM idempotency.idem_sweep();
SELECT string_agg(k::text, '') = :'cancel_rows' AS unchanged FROM (SELECT * FROM idempotency.keys
 WHERE scope = 'wr-cancel' ORDER BY key) k;
DROP TRIGGER wr_cancel_row ON idempotency.keys;
DROP FUNCTION wr_cancel_row();
-- without the trigger the same calls write
SELECT * FROM idempotency.idem_sweep();
SELECT idempotency.idem_release('c-rel', :rel_token, 'wr-cancel');
SELECT key, status, token IS NULL AS token_null FROM idempotency.keys
 WHERE scope = 'wr-cancel' ORDER BY key;

DELETE FROM idempotency.keys WHERE scope LIKE 'wr-%';
DROP FUNCTION wr_log_row();
DROP TABLE wr_snap, wr_sweeps, wr_log;
