/* idempotency--1.3--1.4.sql: update the idempotency extension from 1.3 to 1.4 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.4'" to load this file. \quit

/*
 * 1.4 adds recovery points (idem_checkpoint, and the phase of the last one
 * in idem_claim's and idem_lookup's rows), session-bound claims (a new
 * last argument of idem_claim) and batches (idem_claim_many,
 * idem_finish_many), and a checkpoints column in the stats view.  New
 * columns go at the end of the table, of idem_claim's and idem_lookup's
 * rows and of the stats view; no existing column changes meaning.  The
 * table's new columns are NULL in every stored row, which is what a key
 * without checkpoints and without a session binding has, so adding them
 * rewrites nothing; the new partial index starts empty.
 */
ALTER TABLE idempotency.keys
	ADD COLUMN phase text COLLATE "C",
	ADD COLUMN phase_data jsonb,
	ADD COLUMN owner_session bigint;
CREATE INDEX keys_owner_session_idx ON idempotency.keys (owner_session)
	WHERE owner_session IS NOT NULL;

ALTER TYPE idempotency.claim_result
	ADD ATTRIBUTE phase text,
	ADD ATTRIBUTE phase_data jsonb;

/*
 * A function's arguments and result columns cannot be changed in place:
 * idem_claim, idem_lookup and stats_counters are each created again under
 * a passing name, take over the old one's owner and privileges, replace it
 * and take its name.  An administrator's grants and revokes carry over
 * unchanged (each grant made by its own grantor, in the order of the old
 * ACL); grants made in an extension script would be recorded as the
 * extension's initial privileges, which pg_dump does not dump, so that
 * record is removed again (with the role dependencies PostgreSQL 17 and
 * later keep beside it).  A view or a SQL function with a BEGIN ATOMIC
 * body that uses one of the old functions makes its DROP fail with
 * PostgreSQL's dependency error (2BP01) and the whole update rolls back,
 * leaving 1.3 as it was: drop those objects, update, create them again.
 */
CREATE FUNCTION idempotency.update_take_over(old_fn regprocedure,
											 new_fn regprocedure)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
	my_role	CONSTANT text := pg_catalog.current_setting('role');
	owner	name;
	acl		aclitem[];
	item	record;
BEGIN
	SELECT pg_catalog.pg_get_userbyid(p.proowner), p.proacl INTO owner, acl
	  FROM pg_catalog.pg_proc p WHERE p.oid OPERATOR(pg_catalog.=) old_fn;
	EXECUTE pg_catalog.format('ALTER FUNCTION %s OWNER TO %I', new_fn, owner);
	IF acl IS NULL THEN
		RETURN;
	END IF;

	EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC, %I',
							  new_fn, owner);
	FOR item IN
		SELECT pg_catalog.pg_get_userbyid(a.grantor) AS grantor,
			   CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
					ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(a.grantee))
			   END AS grantee,
			   a.is_grantable
		  FROM pg_catalog.aclexplode(acl) WITH ORDINALITY AS a
		 ORDER BY a.ordinality
	LOOP
		-- a grant someone made with the grant option the owner gave them
		IF item.grantor OPERATOR(pg_catalog.<>) owner THEN
			PERFORM pg_catalog.set_config('role', item.grantor, false);
		END IF;
		EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s%s',
								  new_fn, item.grantee,
								  CASE WHEN item.is_grantable
								  THEN ' WITH GRANT OPTION' ELSE '' END);
		IF item.grantor OPERATOR(pg_catalog.<>) owner THEN
			PERFORM pg_catalog.set_config('role', my_role, false);
		END IF;
	END LOOP;

	DELETE FROM pg_catalog.pg_init_privs i
	 WHERE i.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::regclass
	   AND i.objoid OPERATOR(pg_catalog.=) new_fn;
	DELETE FROM pg_catalog.pg_shdepend d
	 WHERE d.dbid OPERATOR(pg_catalog.=)
			(SELECT db.oid FROM pg_catalog.pg_database db
			  WHERE db.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
	   AND d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::regclass
	   AND d.objid OPERATOR(pg_catalog.=) new_fn
	   AND d.objsubid OPERATOR(pg_catalog.=) 0
	   AND d.deptype OPERATOR(pg_catalog.=) 'i';
END
$fn$;

-- idem_claim: a last argument, session_bound
CREATE FUNCTION idempotency.idem_claim_1_4(
	key			text,
	request		jsonb		DEFAULT NULL,
	scope		text		DEFAULT '',
	lease		interval	DEFAULT NULL,
	retention	interval	DEFAULT NULL,
	wait		interval	DEFAULT '0',
	session_bound boolean	DEFAULT false)
RETURNS SETOF idempotency.claim_result
AS 'MODULE_PATHNAME', 'idem_claim'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;
SELECT idempotency.update_take_over(
	'idempotency.idem_claim(text,jsonb,text,interval,interval,interval)',
	'idempotency.idem_claim_1_4(text,jsonb,text,interval,interval,interval,boolean)');
DROP FUNCTION idempotency.idem_claim(text, jsonb, text, interval, interval,
									 interval);
ALTER FUNCTION idempotency.idem_claim_1_4(text, jsonb, text, interval,
										  interval, interval, boolean)
	RENAME TO idem_claim;

-- idem_lookup: a last column, phase
CREATE FUNCTION idempotency.idem_lookup_1_4(
	key		text,
	scope	text	DEFAULT '')
RETURNS TABLE (status text, attempt integer, response_code integer,
			   response_body jsonb, created_at timestamptz,
			   finished_at timestamptz, expires_at timestamptz,
			   phase text)
AS 'MODULE_PATHNAME', 'idem_lookup'
LANGUAGE C STABLE PARALLEL RESTRICTED ROWS 1;
SELECT idempotency.update_take_over(
	'idempotency.idem_lookup(text,text)',
	'idempotency.idem_lookup_1_4(text,text)');
DROP FUNCTION idempotency.idem_lookup(text, text);
ALTER FUNCTION idempotency.idem_lookup_1_4(text, text) RENAME TO idem_lookup;

-- stats_counters: a last column, checkpoints
CREATE FUNCTION idempotency.stats_counters_1_4(
	OUT dbid oid, OUT claims bigint, OUT takeovers bigint, OUT replays bigint,
	OUT in_progress bigint, OUT mismatches bigint, OUT finishes bigint,
	OUT releases bigint, OUT expired bigint, OUT reset bigint,
	OUT last_sweep_at timestamptz, OUT last_sweep_ms double precision,
	OUT checkpoints bigint)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stats_counters'
LANGUAGE C VOLATILE PARALLEL SAFE;
SELECT idempotency.update_take_over('idempotency.stats_counters()',
									'idempotency.stats_counters_1_4()');

/*
 * The stats view gains its last column, checkpoints, and reads the new
 * counters; the other columns keep their names, types and order, so it is
 * replaced in place: its owner and privileges stay, and options an
 * administrator set on it (which CREATE OR REPLACE VIEW resets) are put
 * back.
 */
DO $do$
DECLARE
	options text[];
BEGIN
	SELECT c.reloptions INTO options FROM pg_catalog.pg_class c
	 WHERE c.oid OPERATOR(pg_catalog.=) 'idempotency.stats'::pg_catalog.regclass;
	EXECUTE $view$
CREATE OR REPLACE VIEW idempotency.stats AS
SELECT d.datname AS database,
	   c.claims, c.takeovers, c.replays, c.in_progress, c.mismatches,
	   c.finishes, c.releases, c.expired, c.reset,
	   c.last_sweep_at, c.last_sweep_ms,
	   k.pending, k.succeeded, k.failed, k.exact AS key_counts_exact,
	   c.checkpoints
  FROM pg_catalog.pg_database d
  LEFT JOIN idempotency.stats_counters_1_4() c
	ON c.dbid OPERATOR(pg_catalog.=) d.oid
  LEFT JOIN idempotency.stats_key_counts() k
	ON d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
 WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
	OR c.dbid IS NOT NULL
$view$;
	IF options IS NOT NULL THEN
		EXECUTE pg_catalog.format('ALTER VIEW idempotency.stats SET (%s)',
								  pg_catalog.array_to_string(options, ', '));
	END IF;
END
$do$;
DROP FUNCTION idempotency.stats_counters();
ALTER FUNCTION idempotency.stats_counters_1_4() RENAME TO stats_counters;

DROP FUNCTION idempotency.update_take_over(regprocedure, regprocedure);

/*
 * A recovery point: the current attempt completed the step "phase"; "data"
 * is what a successor needs to resume after it.  Made in the transaction
 * of the step's own writes, the step and its checkpoint commit together.
 */
CREATE FUNCTION idempotency.idem_checkpoint(
	key		text,
	token	bigint,
	phase	text,
	data	jsonb	DEFAULT NULL,
	scope	text	DEFAULT '')
RETURNS void
AS 'MODULE_PATHNAME', 'idem_checkpoint'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/*
 * Batches: one row per element, in array order.  idem_claim_many answers
 * each element as idem_claim would, claimed one after another in one
 * transaction; idem_finish_many finishes all of them or none.
 */
CREATE FUNCTION idempotency.idem_claim_many(
	keys			text[],
	requests		jsonb[]		DEFAULT NULL,
	scope			text		DEFAULT '',
	lease			interval	DEFAULT NULL,
	retention		interval	DEFAULT NULL,
	session_bound	boolean		DEFAULT false)
RETURNS TABLE (ord integer, key text, outcome text, token bigint,
			   attempt integer, status text, response_code integer,
			   response_body jsonb, retry_after integer, phase text,
			   phase_data jsonb)
AS 'MODULE_PATHNAME', 'idem_claim_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;

CREATE FUNCTION idempotency.idem_finish_many(
	keys			text[],
	tokens			bigint[],
	response_codes	integer[]	DEFAULT NULL,
	response_bodies	jsonb[]		DEFAULT NULL,
	scope			text		DEFAULT '',
	status			text		DEFAULT 'succeeded',
	retention		interval	DEFAULT NULL)
RETURNS TABLE (ord integer, key text, expires_at timestamptz)
AS 'MODULE_PATHNAME', 'idem_finish_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;
