/*-------------------------------------------------------------------------
 *
 * 35_holder.sql
 *	  The calls that present a claim's token: idem_finish,
 *	  idem_finish_many, idem_extend, idem_release and idem_checkpoint.
 *
 * Mirrors holder.c, with those calls' writes of write.c: _token_call locks
 * the key's row when this token holds it, in the query that reads the
 * caller's binding and the store's verdict, and writes; only when it
 * cannot does it read the committed row to say why (P0002, 55000, 55006),
 * and _row_hold asks the row locks of a version another transaction
 * holds, because SQL cannot see the change in flight that the C edition
 * reads (55P03, or a wait while the lease runs).  The API functions check
 * their arguments inline and call _token_call with their owner's rights.
 * Must not claim: a key without a live claim is never created or taken
 * over here.
 *
 *-------------------------------------------------------------------------
 */

/* ---------------------------------------------------------------------
 * The calls that present a token (holder.c)
 * ---------------------------------------------------------------------
 */

/*
 * How another transaction holds the row version at "t", told by the row
 * locks that conflict with its hold, each asked without waiting in one
 * subtransaction that is rolled back at once (so nothing stays locked):
 *   'exclusive'  a delete or FOR UPDATE (FOR KEY SHARE conflicts);
 *   'update'     an update of other columns than the key, or FOR NO KEY
 *                UPDATE, which cannot be told from one (FOR SHARE
 *                conflicts, FOR KEY SHARE does not);
 *   'shared'     only shared row locks (FOR UPDATE conflicts);
 *   'free'       nothing;
 *   'gone'       the version is no longer there: a change committed since
 *                it was read, so the caller reads the key again.
 */
CREATE OR REPLACE FUNCTION idempotency._row_hold(t tid)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	asking text := 'exclusive';
	verdict text := 'gone';
BEGIN
	BEGIN
		PERFORM FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) t
			FOR KEY SHARE NOWAIT;
		IF FOUND THEN
			asking := 'update';
			PERFORM FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) t
				FOR SHARE NOWAIT;
			IF FOUND THEN
				asking := 'shared';
				PERFORM FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) t
					FOR UPDATE NOWAIT;
				IF FOUND THEN
					verdict := 'free';
				END IF;
			END IF;
		END IF;
		RAISE EXCEPTION 'asked' USING ERRCODE = 'IDW02';
	EXCEPTION
		WHEN lock_not_available THEN
			RETURN asking;
		WHEN SQLSTATE 'IDW02' THEN
			RETURN verdict;
	END;
END;
$$;

-- versions before 1.6.3 asked the same in two functions: an update drops
-- them (without a notice on a fresh install)
DO $do$
BEGIN
	IF pg_catalog.to_regprocedure('idempotency._row_locked(tid)') IS NOT NULL THEN
		DROP FUNCTION idempotency._row_locked(tid);
	END IF;
	IF pg_catalog.to_regprocedure('idempotency._being_updated(tid)') IS NOT NULL THEN
		DROP FUNCTION idempotency._being_updated(tid);
	END IF;
END;
$do$;

-- versions before 1.7.0 had no p_remember (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside(
		'idempotency._token_call(name,oid,text,text,bigint,text,integer,jsonb,text,interval,text)');
END;
$do$;

/*
 * One token holder's call, the arguments checked: finish, extend, release
 * or checkpoint the key for the role p_who (oid p_role).  The common case
 * is one query and one write: the row is locked without waiting (FOR NO
 * KEY UPDATE SKIP LOCKED, which reads its newest committed version) only
 * if it is pending under this token within its retention and the binding
 * allows the scope, then written.  Otherwise the committed row says why
 * (absent or past its retention: P0002; finished: 55000; another token's:
 * 55006; the token current but another transaction holding the row:
 * 55P03, or a wait while the lease runs, see below), and no row stays
 * locked.  Returns the key's expiry (finish), the new lease end (extend),
 * or NULL.  A finish stores p_remember (0: not remembered) or, when it is
 * NULL, keeps the claim's, and drops the request a claim kept.  A finish repeated with the token that finished
 * the key answers that finish's expiry and writes nothing.  A remembered
 * key is past its retention: P0002, as for any such key.  No SET clause of its own: it
 * runs only inside the API functions, which pin search_path and the plan
 * cache mode (see _claim_key).
 */
CREATE OR REPLACE FUNCTION idempotency._token_call(p_who name, p_role oid, kind text,
	p_key text, p_token bigint, p_scope text, p_code integer, p_body jsonb,
	p_status text, p_interval interval, p_phase text, p_remember interval,
	OUT result timestamptz, OUT wrote boolean)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
	now timestamptz;
	r record;
	p record;
	disp text;
	hold text;
	row_held boolean;
	step text;
	saved jsonb;
	n bigint;
	rounds integer := 0;
	held_rounds integer := 0;
BEGIN
	wrote := false;
	IF pg_catalog.to_regclass('idempotency.keys') IS NULL OR
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NULL THEN
		PERFORM idempotency._check_store();
	END IF;
	-- Row exclusive on the table before the store's verdict is read: a
	-- lock this transaction did not hold yet makes it take in the DDL
	-- committed meanwhile, and while it is held no code can be attached.
	LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
	LOOP
		now := pg_catalog.clock_timestamp();
		SELECT v.verdict, b.role IS NOT NULL AS bound, b.scope_prefix AS prefix,
			   k.tid, k.attempt, k.created_at, k.expires_at, k.retention, k.sweep_at,
			   k.fingerprint
		  INTO r
		  FROM (SELECT idempotency._store_verdict() AS verdict,
					   'idempotency.token_seq'::pg_catalog.regclass AS seq) v
		  LEFT JOIN idempotency.scope_bindings b
			ON b.role::pg_catalog.oid OPERATOR(pg_catalog.=) p_role
		  LEFT JOIN LATERAL (
			SELECT k.ctid AS tid, k.attempt, k.created_at, k.expires_at, k.retention,
				   k.sweep_at, k.fingerprint
			  FROM idempotency.keys k
			 WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key
			   AND k.status OPERATOR(pg_catalog.=) 'pending' AND k.token OPERATOR(pg_catalog.=) p_token
			   AND k.expires_at OPERATOR(pg_catalog.>) now
			   AND (b.role IS NULL OR pg_catalog.starts_with(p_scope, b.scope_prefix))
			   FOR NO KEY UPDATE OF k SKIP LOCKED) k ON true;
		IF r.bound AND (r.prefix IS NULL OR NOT pg_catalog.starts_with(p_scope, r.prefix)) THEN
			PERFORM idempotency._tenant_refuse(p_who, p_scope, r.prefix);
		END IF;
		IF r.tid IS NOT NULL THEN
			-- the token holds the key, and the row is locked: write
			IF r.attempt IS NULL OR r.created_at IS NULL OR r.retention IS NULL OR
			   r.sweep_at IS NULL OR pg_catalog.octet_length(r.fingerprint) OPERATOR(pg_catalog.<>) 32 THEN
				PERFORM idempotency._check_row(p_scope, p_key, 'pending', r.attempt,
					r.created_at, r.expires_at, r.retention, r.sweep_at, r.fingerprint);
			END IF;
			IF r.verdict OPERATOR(pg_catalog.<>) 0 THEN
				PERFORM idempotency._refuse_write(r.verdict);
				saved := idempotency._settings_save();
			END IF;
			IF kind OPERATOR(pg_catalog.=) 'finish' THEN
				result := now OPERATOR(pg_catalog.+) COALESCE(p_interval, r.retention);
				UPDATE idempotency.keys k
				   SET status = p_status, response_code = p_code,
					   response_body = p_body, finished_at = now,
					   lease_until = NULL, expires_at = result,
					   sweep_at = LEAST(r.sweep_at, result), owner_session = NULL,
					   remember = CASE WHEN p_remember IS NULL THEN k.remember
								  ELSE NULLIF(p_remember, '0'::interval) END,
					   request = NULL
				 WHERE k.ctid OPERATOR(pg_catalog.=) r.tid;
			ELSIF kind OPERATOR(pg_catalog.=) 'extend' THEN
				-- The clock is read again now that the row is locked: an
				-- extend that committed before this one got the lock read it
				-- earlier, so the lease end stored last is the latest one.
				now := pg_catalog.clock_timestamp();
				p_interval := COALESCE(p_interval, idempotency._lease_setting());
				result := now OPERATOR(pg_catalog.+) p_interval;
				UPDATE idempotency.keys k
				   SET lease_until = result,
					   expires_at = GREATEST(now OPERATOR(pg_catalog.+) r.retention, result)
				 WHERE k.ctid OPERATOR(pg_catalog.=) r.tid;
			ELSIF kind OPERATOR(pg_catalog.=) 'release' THEN
				DELETE FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) r.tid;
			ELSE
				UPDATE idempotency.keys k
				   SET phase = p_phase, phase_data = p_body
				 WHERE k.ctid OPERATOR(pg_catalog.=) r.tid;
			END IF;
			GET DIAGNOSTICS n = ROW_COUNT;
			IF saved IS NOT NULL THEN
				PERFORM idempotency._settings_restore(saved);
			END IF;
			IF n OPERATOR(pg_catalog.<>) 1 THEN
				RAISE EXCEPTION 'idempotency key changed during a write'
					USING ERRCODE = '40001',
						  DETAIL = 'Someone changed idempotency.keys outside the extension''s functions.',
						  HINT = 'Retry the transaction.';
			END IF;
			wrote := true;
			RETURN;
		END IF;

		-- Not locked: say why from the committed row, as a claim reads it.
		disp := idempotency._key_display(p_scope, p_key);
		SELECT * INTO p FROM idempotency._probe(p_scope, p_key);
		step := 'go';
		row_held := false;
		-- Another transaction is changing a key whose committed row is this
		-- token's claim.  Without a dirty read the SQL edition cannot see the
		-- new version, so it tells the change by the row lock it holds,
		-- asked without waiting.  While the lease runs, only the token's
		-- holder (an extend, checkpoint, finish or release made elsewhere), a
		-- sweep moving sweep_at, or plain SQL changes the key: an update of
		-- other columns than the key leaves the token current and is waited
		-- for, as a row lock waits (so a deadlock is detected), and the key
		-- is read again.  A delete (a release) or a plain row lock is not
		-- waited for, and neither is any change once the lease has ended (it
		-- may be a takeover): the call is refused (55P03 below).  The
		-- probe's "busy" may be stale (that transaction has ended), so the
		-- lock is asked of the row itself; a version that is gone by then
		-- was replaced by a change that has committed: read again.
		IF p.busy AND p.present AND p.status OPERATOR(pg_catalog.=) 'pending'
		   AND p.token OPERATOR(pg_catalog.=) p_token
		   AND p.expires_at OPERATOR(pg_catalog.>) now THEN
			hold := idempotency._row_hold(p.tid);
			IF hold OPERATOR(pg_catalog.=) 'gone' THEN
				step := 'again';
			ELSIF hold OPERATOR(pg_catalog.=) 'update'
			   AND p.lease_until OPERATOR(pg_catalog.>) now
			   AND (p.owner_session IS NULL OR idempotency._session_alive(p.owner_session)) THEN
				step := 'wait';
			ELSE
				row_held := hold OPERATOR(pg_catalog.<>) 'free';
			END IF;
		END IF;
		IF step OPERATOR(pg_catalog.=) 'go' THEN
			-- what the committed row says is said whatever is in flight
			IF NOT p.present OR p.expires_at OPERATOR(pg_catalog.<=) now THEN
				RAISE EXCEPTION 'idempotency key % does not exist', disp
					USING ERRCODE = 'P0002',
						  DETAIL = 'It was never claimed, was released, or its retention has passed.';
			END IF;
			IF p.status OPERATOR(pg_catalog.<>) 'pending' THEN
				IF kind OPERATOR(pg_catalog.=) 'finish' AND p.token OPERATOR(pg_catalog.=) p_token THEN
					result := p.expires_at;
					RETURN;
				END IF;
				RAISE EXCEPTION 'idempotency key % is already finished', disp
					USING ERRCODE = '55000',
						  DETAIL = CASE WHEN kind OPERATOR(pg_catalog.=) 'finish'
							THEN 'Another attempt stored its result.'
							ELSE pg_catalog.format('Its status is "%s".', p.status) END;
			ELSIF p.token IS DISTINCT FROM p_token THEN
				RAISE EXCEPTION 'token % is not the current token of idempotency key %', p_token, disp
					USING ERRCODE = '55006',
						  DETAIL = CASE WHEN p.token IS NOT NULL
							THEN pg_catalog.format('Attempt %s holds the key now.', p.attempt)
							ELSE 'The sweeper reset the key after its lease ended.' END,
						  HINT = 'Another attempt took the claim over, or this token never held it: do not store this attempt''s result.';
			END IF;
			-- The token is current, and another transaction holds the row.
			-- That may be another token call asking the row's locks
			-- (_row_hold takes each for an instant): ask again for a few
			-- milliseconds before refusing.
			IF row_held AND held_rounds OPERATOR(pg_catalog.<) 20 THEN
				held_rounds := held_rounds OPERATOR(pg_catalog.+) 1;
				PERFORM pg_catalog.pg_sleep(0.001);
				CONTINUE;
			END IF;
			IF row_held THEN
				RAISE EXCEPTION 'could not % idempotency key %', kind, disp
					USING ERRCODE = '55P03',
						  DETAIL = 'Another transaction holds a row lock on this key.',
						  HINT = 'Retry once that transaction has ended.';
			END IF;
			step := 'again';	-- the row changed between the two reads
		END IF;
		IF step OPERATOR(pg_catalog.=) 'wait' THEN
			-- Wait as a row lock waits, so that a deadlock is detected.  The
			-- lock is held for an instant once the wait is over, and another
			-- token call of the key may see it: FOR NO KEY UPDATE reads there
			-- as an update and is waited for in turn, where FOR SHARE would
			-- read as a plain row lock and refuse that call.
			BEGIN
				PERFORM FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) p.tid
					FOR NO KEY UPDATE;
				-- the lock only served to wait: roll it back at once
				RAISE EXCEPTION 'waited' USING ERRCODE = 'IDW01';
			EXCEPTION WHEN SQLSTATE 'IDW01' THEN
				NULL;
			END;
		END IF;
		rounds := rounds OPERATOR(pg_catalog.+) 1;
		IF rounds OPERATOR(pg_catalog.>=) 100 THEN
			RAISE EXCEPTION 'idempotency key changed during a write'
				USING ERRCODE = '40001',
					  DETAIL = 'Someone changed idempotency.keys outside the extension''s functions.',
					  HINT = 'Retry the transaction.';
		END IF;
	END LOOP;
END;
$$;

/*
 * The arguments of a token call, checked in the C edition's order, inline
 * where they are fine: a _check_* function runs only to raise its error.
 */
CREATE OR REPLACE FUNCTION idempotency._token_call_args(fn text, p_key text,
	p_token bigint, p_scope text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	PERFORM idempotency._check_name(p_key, 'key', false);
	PERFORM idempotency._check_name(p_scope, 'scope', true);
	IF p_token IS NULL THEN
		RAISE EXCEPTION 'token must not be null' USING ERRCODE = '22004';
	END IF;
END;
$$;

-- versions before 1.7.0 had no remember argument (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside(
		'idempotency.idem_finish(text,bigint,integer,jsonb,text,text,interval)');
	PERFORM idempotency._update_set_aside(
		'idempotency.idem_finish_many(text[],bigint[],integer[],jsonb[],text,text,interval)');
END;
$do$;

CREATE OR REPLACE FUNCTION idempotency.idem_finish(
	key				text,
	token			bigint,
	response_code	integer		DEFAULT NULL,
	response_body	jsonb		DEFAULT NULL,
	scope			text		DEFAULT '',
	status			text		DEFAULT 'succeeded',
	retention		interval	DEFAULT NULL,
	remember		interval	DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
	r record;
	result timestamptz;
BEGIN
	IF key IS NULL OR token IS NULL OR scope IS NULL OR pg_catalog.octet_length(key) OPERATOR(pg_catalog.=) 0 OR
	   pg_catalog.octet_length(key) OPERATOR(pg_catalog.>) 255 OR pg_catalog.octet_length(scope) OPERATOR(pg_catalog.>) 255 THEN
		PERFORM idempotency._token_call_args('idem_finish()', key, token, scope);
	END IF;
	IF response_body IS NOT NULL AND
	   pg_catalog.pg_column_size(response_body::text::jsonb) OPERATOR(pg_catalog.-) 4 OPERATOR(pg_catalog.>) idempotency._response_limit() THEN
		PERFORM idempotency._check_body(response_body, 'response_body');
	END IF;
	IF status IS NULL OR (status OPERATOR(pg_catalog.<>) 'succeeded' AND status OPERATOR(pg_catalog.<>) 'failed') THEN
		PERFORM idempotency._check_status(status);
	END IF;
	IF retention IS NOT NULL OR remember IS NOT NULL THEN
		PERFORM idempotency._check_positive(retention, 'retention');
		PERFORM idempotency._check_interval(remember, 'remember', true);
	END IF;
	IF pg_catalog.pg_is_in_recovery() OR pg_catalog.current_setting('transaction_read_only')::boolean THEN
		PERFORM idempotency._check_writable('idem_finish()');
	END IF;
	-- The token holds the key, its row is sound, no binding of the caller
	-- refuses the scope and no code is attached to the table: the row
	-- locked and finished right here, as _token_call would.  Anything else
	-- (a refusal, a held row, attached code, a missing table) is
	-- _token_call's, which reads the key again (a row locked here stays
	-- this transaction's).  Row exclusive on the table first (see
	-- idem_claim).
	IF pg_catalog.to_regclass('idempotency.keys') IS NOT NULL AND
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NOT NULL THEN
		LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
		SELECT v.verdict, k.tid, k.retention, k.sweep_at, v.now
		  INTO r
		  FROM (SELECT idempotency._store_verdict() AS verdict,
					   'idempotency.token_seq'::pg_catalog.regclass AS seq,
					   pg_catalog.clock_timestamp() AS now) v
		  LEFT JOIN LATERAL (
			SELECT k.ctid AS tid, k.retention, k.sweep_at
			  FROM idempotency.keys k
			 WHERE k.scope OPERATOR(pg_catalog.=) idem_finish.scope AND k.key OPERATOR(pg_catalog.=) idem_finish.key
			   AND k.status OPERATOR(pg_catalog.=) 'pending' AND k.token OPERATOR(pg_catalog.=) idem_finish.token
			   AND k.expires_at OPERATOR(pg_catalog.>) v.now
			   AND k.attempt IS NOT NULL AND k.created_at IS NOT NULL AND k.retention IS NOT NULL
			   AND k.sweep_at IS NOT NULL
			   AND (k.fingerprint IS NULL OR pg_catalog.octet_length(k.fingerprint) OPERATOR(pg_catalog.=) 32)
			   AND NOT EXISTS (SELECT FROM idempotency.scope_bindings sb
							   WHERE sb.role::pg_catalog.oid OPERATOR(pg_catalog.=)
									 pg_catalog.to_regrole(pg_catalog.quote_ident(who))
								 AND (sb.scope_prefix IS NULL OR
									  NOT pg_catalog.starts_with(idem_finish.scope, sb.scope_prefix)))
			   FOR NO KEY UPDATE OF k SKIP LOCKED) k ON true;
		IF r.tid IS NOT NULL AND r.verdict OPERATOR(pg_catalog.=) 0 THEN
			result := r.now OPERATOR(pg_catalog.+) COALESCE(retention, r.retention);
			UPDATE idempotency.keys k
			   SET status = idem_finish.status, response_code = idem_finish.response_code,
				   response_body = idem_finish.response_body, finished_at = r.now,
				   lease_until = NULL, expires_at = result,
				   sweep_at = LEAST(r.sweep_at, result), owner_session = NULL,
				   remember = CASE WHEN idem_finish.remember IS NULL THEN k.remember
							  ELSE NULLIF(idem_finish.remember, '0'::interval) END,
				   request = NULL
			 WHERE k.ctid OPERATOR(pg_catalog.=) r.tid;
			IF FOUND THEN
				RETURN result;
			END IF;
		END IF;
	END IF;
	RETURN (idempotency._token_call(who, pg_catalog.to_regrole(pg_catalog.quote_ident(who)), 'finish',
		key, token, scope, response_code, response_body, status, retention, NULL, remember)).result;
END;
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_extend(
	key		text,
	token	bigint,
	lease	interval	DEFAULT NULL,
	scope	text		DEFAULT '')
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
BEGIN
	PERFORM idempotency._token_call_args('idem_extend()', key, token, scope);
	PERFORM idempotency._check_positive(lease, 'lease');
	PERFORM idempotency._check_writable('idem_extend()');
	RETURN (idempotency._token_call(who, pg_catalog.to_regrole(pg_catalog.quote_ident(who)), 'extend',
		key, token, scope, NULL, NULL, NULL, lease, NULL, NULL)).result;
END;
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_release(
	key		text,
	token	bigint,
	scope	text	DEFAULT '')
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
BEGIN
	PERFORM idempotency._token_call_args('idem_release()', key, token, scope);
	PERFORM idempotency._check_writable('idem_release()');
	PERFORM idempotency._token_call(who, pg_catalog.to_regrole(pg_catalog.quote_ident(who)), 'release',
		key, token, scope, NULL, NULL, NULL, NULL, NULL, NULL);
END;
$$;

/*
 * A recovery point: the current attempt completed the step "phase"; "data"
 * is what a successor needs to resume after it.  Made in the transaction
 * of the step's own writes, the step and its checkpoint commit together.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_checkpoint(
	key		text,
	token	bigint,
	phase	text,
	data	jsonb	DEFAULT NULL,
	scope	text	DEFAULT '')
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
BEGIN
	PERFORM idempotency._token_call_args('idem_checkpoint()', key, token, scope);
	PERFORM idempotency._check_name(phase, 'phase', false);
	PERFORM idempotency._check_body(data, 'data');
	PERFORM idempotency._check_writable('idem_checkpoint()');
	PERFORM idempotency._token_call(who, pg_catalog.to_regrole(pg_catalog.quote_ident(who)), 'checkpoint',
		key, token, scope, NULL, data, NULL, NULL, phase, NULL);
END;
$$;

/*
 * idem_finish_many: every argument checked first, then each key finished
 * as idem_finish would; the first refusal raises its error, which undoes
 * the elements finished before it.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_finish_many(
	keys			text[],
	tokens			bigint[],
	response_codes	integer[]	DEFAULT NULL,
	response_bodies	jsonb[]		DEFAULT NULL,
	scope			text		DEFAULT '',
	status			text		DEFAULT 'succeeded',
	retention		interval	DEFAULT NULL,
	remember		interval	DEFAULT NULL)
RETURNS TABLE (ord integer, key text, expires_at timestamptz)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 100 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
	role oid;
	k text[];
	t bigint[];
	c integer[];
	b jsonb[];
	n integer;
	lim bigint;
	now timestamptz;
	fin_at timestamptz[];
	e_state text;
	e_message text;
	e_detail text;
	e_hint text;
BEGIN
	PERFORM idempotency._check_array(pg_catalog.array_ndims(keys), 'keys', true, keys IS NULL);
	PERFORM idempotency._check_array(pg_catalog.array_ndims(tokens), 'tokens', true, tokens IS NULL);
	PERFORM idempotency._check_array(pg_catalog.array_ndims(response_codes), 'response_codes', false, response_codes IS NULL);
	PERFORM idempotency._check_array(pg_catalog.array_ndims(response_bodies), 'response_bodies', false, response_bodies IS NULL);
	k := ARRAY(SELECT u FROM pg_catalog.unnest(keys) u);
	t := ARRAY(SELECT u FROM pg_catalog.unnest(tokens) u);
	n := pg_catalog.cardinality(k);
	PERFORM idempotency._check_batch_length(pg_catalog.cardinality(t), 'tokens', n);
	IF response_codes IS NOT NULL THEN
		c := ARRAY(SELECT u FROM pg_catalog.unnest(response_codes) u);
		PERFORM idempotency._check_batch_length(pg_catalog.cardinality(c), 'response_codes', n);
	END IF;
	IF response_bodies IS NOT NULL THEN
		b := ARRAY(SELECT u FROM pg_catalog.unnest(response_bodies) u);
		PERFORM idempotency._check_batch_length(pg_catalog.cardinality(b), 'response_bodies', n);
	END IF;
	FOR i IN 1..n LOOP
		IF k[i] IS NULL OR pg_catalog.octet_length(k[i]) OPERATOR(pg_catalog.=) 0 OR
		   pg_catalog.octet_length(k[i]) OPERATOR(pg_catalog.>) 255 THEN
			PERFORM idempotency._check_name(k[i], pg_catalog.format('keys[%s]', i), false);
		END IF;
	END LOOP;
	lim := idempotency._response_limit();
	FOR i IN 1..n LOOP
		IF t[i] IS NULL THEN
			RAISE EXCEPTION 'tokens[%] must not be null', i USING ERRCODE = '22004';
		END IF;
		IF b[i] IS NOT NULL AND
		   pg_catalog.pg_column_size(b[i]::text::jsonb) OPERATOR(pg_catalog.-) 4 OPERATOR(pg_catalog.>) lim THEN
			PERFORM idempotency._check_body(b[i], pg_catalog.format('response_bodies[%s]', i));
		END IF;
	END LOOP;
	PERFORM idempotency._check_name(scope, 'scope', true);
	PERFORM idempotency._check_status(status);
	PERFORM idempotency._check_positive(retention, 'retention');
	PERFORM idempotency._check_interval(remember, 'remember', true);
	PERFORM idempotency._check_writable('idem_finish_many()');
	role := pg_catalog.to_regrole(pg_catalog.quote_ident(who));
	-- Row exclusive on the table before the store's verdict is read (see
	-- idem_claim).
	IF pg_catalog.to_regclass('idempotency.keys') IS NOT NULL AND
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NOT NULL THEN
		LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
	END IF;
	-- One block for the whole batch (a block per element would open a
	-- subtransaction per key): the element that fails is in ord and key.
	BEGIN
		-- The whole batch in one statement, in read committed, when no code
		-- is attached to the table, no binding of the caller refuses the
		-- scope and the keys are distinct: every row the token holds,
		-- sound, locked without waiting and finished as _token_call
		-- finishes one.  All or nothing: when it cannot finish every
		-- element, the inner block's subtransaction takes back what it did
		-- (so that no row stays locked out of order) and every element is
		-- finished or refused one by one below, in order, by _token_call.
		-- An error here (the store's verdict) is the first element's, as
		-- its own call would raise it.
		ord := 1;
		key := k[1];
		IF n OPERATOR(pg_catalog.>) 0 AND
		   pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.=) 'read committed' AND
		   pg_catalog.to_regclass('idempotency.keys') IS NOT NULL AND
		   pg_catalog.to_regclass('idempotency.scope_bindings') IS NOT NULL AND
		   (SELECT v.verdict OPERATOR(pg_catalog.=) 0 AND
				   NOT EXISTS (SELECT FROM idempotency.scope_bindings sb
							   WHERE sb.role::pg_catalog.oid OPERATOR(pg_catalog.=) pg_catalog.to_regrole(pg_catalog.quote_ident(who))
								 AND (sb.scope_prefix IS NULL OR
									  NOT pg_catalog.starts_with(idem_finish_many.scope, sb.scope_prefix))) AND
				   (SELECT pg_catalog.count(DISTINCT u) FROM pg_catalog.unnest(k) u) OPERATOR(pg_catalog.=) n
			  FROM (SELECT idempotency._store_verdict() AS verdict,
						   'idempotency.token_seq'::pg_catalog.regclass AS seq) v
			  LEFT JOIN idempotency.keys kk ON false) THEN
			BEGIN
				now := pg_catalog.clock_timestamp();
				-- each element's row looked up by its key (a lateral lookup,
				-- so that no plan made for a table without statistics scans
				-- it once per element)
				WITH held AS (
					SELECT u.i, kk.tid, u.code, u.body,
						   now OPERATOR(pg_catalog.+) COALESCE(idem_finish_many.retention, kk.retention) AS expires
					  FROM ROWS FROM (pg_catalog.unnest(k), pg_catalog.unnest(t), pg_catalog.unnest(c),
									  pg_catalog.unnest(b)) WITH ORDINALITY u(key, token, code, body, i)
					  CROSS JOIN LATERAL (
						SELECT kk.ctid AS tid, kk.retention
						  FROM idempotency.keys kk
						 WHERE kk.scope OPERATOR(pg_catalog.=) idem_finish_many.scope
						   AND kk.key OPERATOR(pg_catalog.=) u.key
						   AND kk.status OPERATOR(pg_catalog.=) 'pending' AND kk.token OPERATOR(pg_catalog.=) u.token
						   AND kk.expires_at OPERATOR(pg_catalog.>) now
						   AND kk.attempt IS NOT NULL AND kk.created_at IS NOT NULL AND kk.retention IS NOT NULL
						   AND kk.sweep_at IS NOT NULL
						   AND (kk.fingerprint IS NULL OR pg_catalog.octet_length(kk.fingerprint) OPERATOR(pg_catalog.=) 32)
						   FOR NO KEY UPDATE OF kk SKIP LOCKED) kk),
				done AS (
					UPDATE idempotency.keys kk
					   SET status = idem_finish_many.status, response_code = held.code,
						   response_body = held.body, finished_at = now,
						   lease_until = NULL, expires_at = held.expires,
						   sweep_at = LEAST(kk.sweep_at, held.expires), owner_session = NULL,
						   remember = CASE WHEN idem_finish_many.remember IS NULL THEN kk.remember
									  ELSE NULLIF(idem_finish_many.remember, '0'::interval) END,
						   request = NULL
					  FROM held
					 WHERE kk.ctid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT h.tid FROM held h))
					   AND kk.ctid OPERATOR(pg_catalog.=) held.tid
					RETURNING held.i, held.expires)
				SELECT pg_catalog.array_agg(done.expires ORDER BY done.i)
				  INTO fin_at
				  FROM done;
				IF pg_catalog.cardinality(fin_at) IS DISTINCT FROM n THEN
					RAISE EXCEPTION 'not every element' USING ERRCODE = 'IDB01';
				END IF;
			EXCEPTION WHEN SQLSTATE 'IDB01' THEN
				fin_at := NULL;
			END;
			IF fin_at IS NOT NULL THEN
				RETURN QUERY SELECT u.i::integer, u.key, u.expires
				  FROM ROWS FROM (pg_catalog.unnest(k), pg_catalog.unnest(fin_at))
					   WITH ORDINALITY u(key, expires, i);
				RETURN;
			END IF;
		END IF;
		FOR i IN 1..n LOOP
			ord := i;
			key := k[i];
			expires_at := (idempotency._token_call(who, role, 'finish', k[i], t[i], scope,
				c[i], b[i], status, retention, NULL, remember)).result;
			RETURN NEXT;
		END LOOP;
	EXCEPTION WHEN OTHERS THEN
		-- the element's position and key before the message, every other
		-- field as idem_finish raises it (a cancel is not caught: it is
		-- about the statement, not an element)
		GET STACKED DIAGNOSTICS e_state = RETURNED_SQLSTATE, e_message = MESSAGE_TEXT,
			e_detail = PG_EXCEPTION_DETAIL, e_hint = PG_EXCEPTION_HINT;
		PERFORM idempotency._raise(e_state,
			pg_catalog.format('idem_finish_many element %s, key %s: %s', ord,
				idempotency._key_display(scope, key), e_message),
			e_detail, e_hint);
	END;
END;
$$;
