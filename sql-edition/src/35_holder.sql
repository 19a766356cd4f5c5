/*-------------------------------------------------------------------------
 *
 * 35_holder.sql
 *	  The calls that present a claim's token: idem_finish,
 *	  idem_finish_many, idem_extend, idem_release and idem_checkpoint.
 *
 * Mirrors holder.c, with those calls' writes of write.c: the worker
 * _w_token_call judges the token against the key's committed row (P0002,
 * 55000, 55006) and writes under the key's advisory lock, and _row_hold
 * asks the row locks of a version another transaction holds, because SQL
 * cannot see the change in flight that the C edition reads (55P03, or a
 * wait while the lease runs).  Must not claim: a key without a live claim
 * is never created or taken over here.
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

/*
 * One token holder's call: finish, extend, release or checkpoint the key.
 * Judges the token against the key's committed row (absent or past its
 * retention: P0002; finished: 55000; another token's: 55006), then locks
 * the row without waiting (another transaction changing or locking it:
 * 55P03) and writes.  Returns the key's expiry (finish), the new lease end
 * (extend), or NULL.  A finish repeated with the token that finished the
 * key answers that finish's expiry and writes nothing.
 */
CREATE OR REPLACE FUNCTION idempotency._w_token_call(caller name, kind text,
	p_key text, p_token bigint, p_scope text, p_code integer, p_body jsonb,
	p_status text, p_interval interval, p_phase text,
	OUT result timestamptz, OUT wrote boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	fn text := 'idem_' OPERATOR(pg_catalog.||) kind OPERATOR(pg_catalog.||) '()';
	now timestamptz;
	p record;
	h integer;
	disp text;
	locked tid;
	n bigint;
	step text;
	hold text;
	row_held boolean;
	gone integer := 0;
BEGIN
	IF kind IS NULL OR kind OPERATOR(pg_catalog.<>) ALL (ARRAY['finish', 'extend', 'release', 'checkpoint']) THEN
		RAISE EXCEPTION 'unknown token call "%"', kind USING ERRCODE = '22023';
	END IF;
	PERFORM idempotency._check_name(p_key, 'key', false);
	PERFORM idempotency._check_name(p_scope, 'scope', true);
	IF p_token IS NULL THEN
		RAISE EXCEPTION 'token must not be null' USING ERRCODE = '22004';
	END IF;
	IF kind OPERATOR(pg_catalog.=) 'finish' THEN
		PERFORM idempotency._check_body(p_body, 'response_body');
		PERFORM idempotency._check_status(p_status);
		PERFORM idempotency._check_positive(p_interval, 'retention');
	ELSIF kind OPERATOR(pg_catalog.=) 'extend' THEN
		PERFORM idempotency._check_positive(p_interval, 'lease');
	ELSIF kind OPERATOR(pg_catalog.=) 'checkpoint' THEN
		PERFORM idempotency._check_name(p_phase, 'phase', false);
		PERFORM idempotency._check_body(p_body, 'data');
	END IF;
	PERFORM idempotency._check_writable(fn);
	PERFORM idempotency._tenant_check(caller, p_scope);
	PERFORM idempotency._check_catalog();
	wrote := false;
	h := idempotency._key_hash(p_scope, p_key);
	disp := idempotency._key_display(p_scope, p_key);
	LOOP
		PERFORM pg_catalog.pg_advisory_lock(idempotency._lock_class(), h);
		BEGIN
			now := pg_catalog.clock_timestamp();
			SELECT * INTO p FROM idempotency._probe(p_scope, p_key);
			step := 'go';
			row_held := false;
			-- Another transaction is changing a key whose committed row is
			-- this token's claim.  Without a dirty read the SQL edition
			-- cannot see the new version, so it tells the change by the row
			-- lock it holds, asked without waiting.  While the lease runs,
			-- only the token's holder (an extend, checkpoint, finish or
			-- release made elsewhere), a sweep moving sweep_at, or plain SQL
			-- changes the key: an update of other columns than the key
			-- leaves the token current and is waited for, as a row lock
			-- waits (so a deadlock is detected), without the key's lock,
			-- and the key is read again.  A delete (a release) or a plain
			-- row lock is not waited for, and neither is any change once
			-- the lease has ended (it may be a takeover): a lock still held
			-- then refuses the call (55P03 below).  The probe's "busy" may
			-- be stale (that transaction has ended) or read from a
			-- transaction id that only looks running (an aborted row lock's
			-- id that is also a live multixact's number), so the lock is
			-- asked of the row itself; a version that is gone by then was
			-- replaced by a change that has committed: read again.
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
					ELSE
						RAISE EXCEPTION 'idempotency key % is already finished', disp
							USING ERRCODE = '55000',
								  DETAIL = CASE WHEN kind OPERATOR(pg_catalog.=) 'finish'
									THEN 'Another attempt stored its result.'
									ELSE pg_catalog.format('Its status is "%s".', p.status) END;
					END IF;
				ELSIF p.token IS DISTINCT FROM p_token THEN
					RAISE EXCEPTION 'token % is not the current token of idempotency key %', p_token, disp
						USING ERRCODE = '55006',
							  DETAIL = CASE WHEN p.token IS NOT NULL
								THEN pg_catalog.format('Attempt %s holds the key now.', p.attempt)
								ELSE 'The sweeper reset the key after its lease ended.' END,
							  HINT = 'Another attempt took the claim over, or this token never held it: do not store this attempt''s result.';
				END IF;
			END IF;
			IF step OPERATOR(pg_catalog.=) 'go' AND result IS NULL THEN
				-- the token is current
				IF row_held THEN
					RAISE EXCEPTION 'could not % idempotency key %', kind, disp
						USING ERRCODE = '55P03',
							  DETAIL = 'Another transaction holds a row lock on this key.',
							  HINT = 'Retry once that transaction has ended.';
				END IF;
				-- every writer of the key holds its advisory lock, which we hold:
				-- the version probed is the one to write (no row lock, which
				-- would stay on the new version and look like a change in flight)
				locked := p.tid;
				IF kind OPERATOR(pg_catalog.=) 'finish' THEN
					result := now OPERATOR(pg_catalog.+) COALESCE(p_interval, p.retention);
					UPDATE idempotency.keys k
					   SET status = p_status, response_code = p_code,
						   response_body = p_body, finished_at = now,
						   lease_until = NULL, expires_at = result,
						   sweep_at = LEAST(p.sweep_at, result), owner_session = NULL
					 WHERE k.ctid OPERATOR(pg_catalog.=) locked;
				ELSIF kind OPERATOR(pg_catalog.=) 'extend' THEN
					result := now OPERATOR(pg_catalog.+) COALESCE(p_interval,
						idempotency._guc_interval('idempotency.lease', 'ms', '00:00:30'));
					UPDATE idempotency.keys k
					   SET lease_until = result,
						   expires_at = GREATEST(now OPERATOR(pg_catalog.+) p.retention, result)
					 WHERE k.ctid OPERATOR(pg_catalog.=) locked;
				ELSIF kind OPERATOR(pg_catalog.=) 'release' THEN
					DELETE FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) locked;
				ELSE
					UPDATE idempotency.keys k
					   SET phase = p_phase, phase_data = p_body
					 WHERE k.ctid OPERATOR(pg_catalog.=) locked;
				END IF;
				GET DIAGNOSTICS n = ROW_COUNT;
				IF n OPERATOR(pg_catalog.=) 1 THEN
					wrote := true;
				ELSIF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' OR
					  gone OPERATOR(pg_catalog.>=) 100 THEN
					RAISE EXCEPTION 'idempotency key changed during a write'
						USING ERRCODE = '40001',
							  DETAIL = 'Someone changed idempotency.keys outside the extension''s functions.',
							  HINT = 'Retry the transaction.';
				ELSE
					-- The version probed was replaced by a change that
					-- committed since (see _probe): read the key again.  The
					-- statement locked the newest version while it looked for
					-- ours: roll that lock back, or a sweep that waits for it
					-- while it holds the key's lock would wait for us, and we
					-- for it.
					RAISE EXCEPTION 'version gone' USING ERRCODE = 'IDW03';
				END IF;
			END IF;
		EXCEPTION
			WHEN SQLSTATE 'IDW03' THEN
				gone := gone OPERATOR(pg_catalog.+) 1;
				result := NULL;
				step := 'again';
			WHEN lock_not_available THEN
				PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
				RAISE EXCEPTION 'could not % idempotency key %', kind, disp
					USING ERRCODE = '55P03',
						  DETAIL = 'Another transaction holds a row lock on this key.',
						  HINT = 'Retry once that transaction has ended.';
			WHEN OTHERS OR query_canceled THEN
				PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
				RAISE;
		END;
		PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
		EXIT WHEN step OPERATOR(pg_catalog.=) 'go';
		IF step OPERATOR(pg_catalog.=) 'wait' THEN
			-- Wait as a row lock waits, so that a deadlock is detected.
			-- The lock is held for an instant once the wait is over, and
			-- another token call of the key may see it: FOR NO KEY UPDATE
			-- reads there as an update and is waited for in turn, where
			-- FOR SHARE would read as a plain row lock and refuse that
			-- call.
			BEGIN
				PERFORM FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) p.tid
					FOR NO KEY UPDATE;
				-- the lock only served to wait: roll it back at once
				RAISE EXCEPTION 'waited' USING ERRCODE = 'IDW01';
			EXCEPTION WHEN SQLSTATE 'IDW01' THEN
				NULL;
			END;
		END IF;
	END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_finish(
	key				text,
	token			bigint,
	response_code	integer		DEFAULT NULL,
	response_body	jsonb		DEFAULT NULL,
	scope			text		DEFAULT '',
	status			text		DEFAULT 'succeeded',
	retention		interval	DEFAULT NULL)
RETURNS timestamptz
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
RETURN (SELECT w.result FROM idempotency._w_token_call(current_user, 'finish', key,
	token, scope, response_code, response_body, status, retention, NULL) w);

CREATE OR REPLACE FUNCTION idempotency.idem_extend(
	key		text,
	token	bigint,
	lease	interval	DEFAULT NULL,
	scope	text		DEFAULT '')
RETURNS timestamptz
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
RETURN (SELECT w.result FROM idempotency._w_token_call(current_user, 'extend', key,
	token, scope, NULL, NULL, NULL, lease, NULL) w);

CREATE OR REPLACE FUNCTION idempotency.idem_release(
	key		text,
	token	bigint,
	scope	text	DEFAULT '')
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	PERFORM idempotency._w_token_call(current_user, 'release', key, token, scope,
		NULL, NULL, NULL, NULL, NULL);
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
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	PERFORM idempotency._w_token_call(current_user, 'checkpoint', key, token, scope,
		NULL, data, NULL, NULL, phase);
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
	retention		interval	DEFAULT NULL)
RETURNS TABLE (ord integer, key text, expires_at timestamptz)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 100
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	k text[];
	t bigint[];
	c integer[];
	b jsonb[];
	n integer;
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
		PERFORM idempotency._check_name(k[i], pg_catalog.format('keys[%s]', i), false);
	END LOOP;
	FOR i IN 1..n LOOP
		IF t[i] IS NULL THEN
			RAISE EXCEPTION 'tokens[%] must not be null', i USING ERRCODE = '22004';
		END IF;
		IF b IS NOT NULL THEN
			PERFORM idempotency._check_body(b[i], pg_catalog.format('response_bodies[%s]', i));
		END IF;
	END LOOP;
	PERFORM idempotency._check_name(scope, 'scope', true);
	PERFORM idempotency._check_status(status);
	PERFORM idempotency._check_positive(retention, 'retention');
	PERFORM idempotency._check_writable('idem_finish_many()');
	-- One block for the whole loop (a block per element would open a
	-- subtransaction per key): the element that fails is in ord and key.
	BEGIN
		FOR i IN 1..n LOOP
			ord := i;
			key := k[i];
			SELECT w.result INTO expires_at
			  FROM idempotency._w_token_call(current_user, 'finish', k[i], t[i], scope,
				   c[i], b[i], status, retention, NULL) w;
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
