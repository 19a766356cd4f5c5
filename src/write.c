/*-------------------------------------------------------------------------
 *
 * write.c
 *	  Every change to idempotency.keys.
 *
 * Owns the write rules: one table (write_rules) says, for each kind of
 * write, whether it inserts, updates or deletes, which columns it sets,
 * and whether a row that another transaction changes or locks is skipped
 * (the sweep's writes) or is an error (everything else, whose caller
 * probed the row under the key's lock).  Both ways of writing follow that
 * table: the direct writer (direct.c) where the table is as the extension
 * made it, and otherwise an SQL statement built from the same rule and
 * prepared once per backend, so that a user's trigger, rule or row
 * security still applies (not on Citus's shards, which only the direct
 * writer writes).  Every write runs as the table's owner in a
 * restricted security context (a write section).
 * Must not decide outcomes (claim.c, holder.c and sweep.c do), and must
 * never wait on another transaction's row: callers write only under the
 * key's lock, after a probe showed that nobody else is changing the row,
 * and count every write (idem_key_wrote) before releasing the lock.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/relation.h"
#include "access/table.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_depend.h"
#include "catalog/pg_namespace.h"
#include "catalog/pg_class.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/resowner.h"
#include "utils/timestamp.h"

#include "store.h"

/* The kinds of write. */
typedef enum WriteKind
{
	WRITE_CLAIM_INSERT,
	WRITE_CLAIM_RENEW,
	WRITE_CLAIM_TAKEOVER,
	WRITE_CLAIM_TAKEOVER_REQUEST,
	WRITE_FINISH,
	WRITE_CHECKPOINT,
	WRITE_EXTEND,
	WRITE_RELEASE,
	WRITE_SWEEP_DELETE,
	WRITE_SWEEP_RESET,
	WRITE_SWEEP_RESCHEDULE,
	WRITE_SWEEP_COMPACT,
	NUM_WRITE_KINDS
} WriteKind;

/* The columns 1 .. n. */
#define COLUMNS_UPTO(n)			(KEYS_COL_BIT((n) + 1) - 1)
#define ALL_COLUMNS				COLUMNS_UPTO(KEYS_NCOLS)
#define CHECKPOINT_COLUMNS		(KEYS_COL_BIT(KEYS_COL_PHASE) | KEYS_COL_BIT(KEYS_COL_PHASE_DATA))

typedef struct WriteRule
{
	CmdType		cmd;			/* CMD_INSERT, CMD_UPDATE or CMD_DELETE */
	uint32		columns;		/* the columns it sets (KEYS_COL_BIT bits) */
	bool		skip_busy;		/* skip a row changed or locked by others */
} WriteRule;

static const WriteRule write_rules[NUM_WRITE_KINDS] = {
	[WRITE_CLAIM_INSERT] = {CMD_INSERT, ALL_COLUMNS, false},
	/* a fresh claim over a row past its retention: its checkpoint goes */
	[WRITE_CLAIM_RENEW] = {CMD_UPDATE,
	ALL_COLUMNS & ~(KEYS_COL_BIT(KEYS_COL_SCOPE) | KEYS_COL_BIT(KEYS_COL_KEY)), false},

	/*
	 * A takeover: the new attempt resumes from the last checkpoint, with the
	 * request an earlier attempt kept ...
	 */
	[WRITE_CLAIM_TAKEOVER] = {CMD_UPDATE,
		ALL_COLUMNS & ~(KEYS_COL_BIT(KEYS_COL_SCOPE) | KEYS_COL_BIT(KEYS_COL_KEY) |
						CHECKPOINT_COLUMNS | KEYS_COL_BIT(KEYS_COL_REQUEST)), false},
	/* ... or keeping its own (the same request: the fingerprints match) */
	[WRITE_CLAIM_TAKEOVER_REQUEST] = {CMD_UPDATE,
		ALL_COLUMNS & ~(KEYS_COL_BIT(KEYS_COL_SCOPE) | KEYS_COL_BIT(KEYS_COL_KEY) |
						CHECKPOINT_COLUMNS), false},

	/*
	 * A finished key is bound to no session and keeps no request.  Setting
	 * owner_session from NULL to NULL changes nothing, so a plain claim's
	 * finish stays a HOT update.
	 */
	[WRITE_FINISH] = {CMD_UPDATE,
		KEYS_COL_BIT(KEYS_COL_STATUS) | KEYS_COL_BIT(KEYS_COL_RESPONSE_CODE) |
		KEYS_COL_BIT(KEYS_COL_RESPONSE_BODY) | KEYS_COL_BIT(KEYS_COL_FINISHED_AT) |
		KEYS_COL_BIT(KEYS_COL_LEASE_UNTIL) | KEYS_COL_BIT(KEYS_COL_EXPIRES_AT) |
		KEYS_COL_BIT(KEYS_COL_SWEEP_AT) | KEYS_COL_BIT(KEYS_COL_OWNER_SESSION) |
	KEYS_COL_BIT(KEYS_COL_REMEMBER) | KEYS_COL_BIT(KEYS_COL_REQUEST), false},
	[WRITE_CHECKPOINT] = {CMD_UPDATE, CHECKPOINT_COLUMNS, false},
	[WRITE_EXTEND] = {CMD_UPDATE,
	KEYS_COL_BIT(KEYS_COL_LEASE_UNTIL) | KEYS_COL_BIT(KEYS_COL_EXPIRES_AT), false},
	[WRITE_RELEASE] = {CMD_DELETE, 0, false},

	/*
	 * The sweep locked each key and re-read its row, but a row changed or
	 * row-locked by plain SQL since is skipped, never waited on: waiting
	 * could deadlock with, say, an administrator's DELETE that waits for this
	 * sweep.
	 */
	[WRITE_SWEEP_DELETE] = {CMD_DELETE, 0, true},
	[WRITE_SWEEP_RESET] = {CMD_UPDATE,
		KEYS_COL_BIT(KEYS_COL_TOKEN) | KEYS_COL_BIT(KEYS_COL_SWEEP_AT) | KEYS_COL_BIT(KEYS_COL_OWNER_SESSION),
	true},
	[WRITE_SWEEP_RESCHEDULE] = {CMD_UPDATE, KEYS_COL_BIT(KEYS_COL_SWEEP_AT), true},
	/* a remembered key keeps its outcome, not what it answered with */
	[WRITE_SWEEP_COMPACT] = {CMD_UPDATE,
		KEYS_COL_BIT(KEYS_COL_RESPONSE_BODY) | KEYS_COL_BIT(KEYS_COL_SWEEP_AT) |
	CHECKPOINT_COLUMNS | KEYS_COL_BIT(KEYS_COL_REQUEST), true},
};

/*
 * The statement of each kind, prepared at its first use in this backend for
 * a table of write_plans_ncols columns (an update of the extension in
 * another session adds columns: the statements are prepared again).
 */
static SPIPlanPtr write_plans[NUM_WRITE_KINDS];
static int	write_plans_ncols = 0;
static uint32 write_plans_key_columns = 0;	/* and its IdemCatalog.key_columns */

/* The columns of a rule that the table has. */
static uint32
write_columns(const WriteRule *rule)
{
	return rule->columns & COLUMNS_UPTO(idem_catalog()->ncols);
}

/* A write's values, one per column (those of the rule's columns are used). */
typedef struct WriteRow
{
	ItemPointerData tid;		/* the row version it changes (not an insert) */
	Datum		values[KEYS_NCOLS];
	bool		nulls[KEYS_NCOLS];
} WriteRow;

/* The identity and settings to restore at the end of a write section. */
typedef struct WriteSection
{
	Oid			saved_userid;
	int			saved_sec_context;
	int			guc_nestlevel;
	bool		user_code;		/* the table runs a user's code in a write */
} WriteSection;

/*
 * Does the caller's session have temporary tables or types, the objects
 * PostgreSQL finds in its temporary schema by an unqualified name (it
 * never looks functions or operators up there)?  Every object of a schema
 * depends on it: the entries of pg_depend that reference the session's
 * temporary schema list them.
 */
static bool
write_caller_has_temp_objects(void)
{
	Oid			temp_namespace;
	Oid			temp_toast_namespace;
	Relation	depend;
	ScanKeyData key[2];
	SysScanDesc scan;
	HeapTuple	tuple;
	bool		found;

	GetTempNamespaceState(&temp_namespace, &temp_toast_namespace);
	if (!OidIsValid(temp_namespace))
		return false;
	depend = table_open(DependRelationId, AccessShareLock);
	ScanKeyInit(&key[0], Anum_pg_depend_refclassid, BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(NamespaceRelationId));
	ScanKeyInit(&key[1], Anum_pg_depend_refobjid, BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(temp_namespace));
	scan = systable_beginscan(depend, DependReferenceIndexId, true, NULL, 2, key);
	found = false;
	while (!found && HeapTupleIsValid(tuple = systable_getnext(scan)))
	{
		Oid			classid = ((Form_pg_depend) GETSTRUCT(tuple))->classid;

		found = classid == RelationRelationId || classid == TypeRelationId;
	}
	systable_endscan(scan);
	table_close(depend, AccessShareLock);
	return found;
}

/*
 * Pin search_path to pg_catalog, pg_temp before each row a user's code can
 * see, so that a path one row's trigger set does not carry over to the
 * next row.  The first pin opens the section's GUC nest level, which
 * write_section_end pops with everything set inside it.
 */
static void
write_section_pin(WriteSection *section)
{
	if (section->guc_nestlevel == 0)
		section->guc_nestlevel = NewGUCNestLevel();
	(void) set_config_option("search_path", "pg_catalog, pg_temp",
							 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE,
							 true, 0, false);
}

/*
 * Act as the table's owner, with restricted security, until
 * write_section_end: the caller need not have any privilege on the table,
 * and nothing the table's owner attached (a trigger, a rule, a CHECK
 * constraint, an index expression) can change session state.  When the
 * table has such code (IdemCatalog.user_code), search_path is also pinned
 * to pg_catalog, pg_temp, so that none of it can resolve a name in a
 * schema the caller controls, as PostgreSQL runs index expressions in its
 * maintenance commands.  A table without it looks no name up in a write
 * (its rows go through the table AM and PostgreSQL's own index operator
 * classes): there the pin, which costs a GUC nest level and makes the
 * caller's next statement parse its path again, is left out.
 *
 * There, unlike in those commands, pg_temp is the caller's own temporary
 * schema, and PostgreSQL looks tables and types up in it whatever the path
 * says: a caller's temporary table named like an unqualified table in a
 * trigger would receive a write made with the owner's rights, and its own
 * triggers would run as the owner.  So a write that can run a user's code
 * (IdemCatalog.user_code) is refused while the caller's session has
 * temporary tables or types.  A trigger that fires at commit would run
 * outside any section: a write is refused while the table has one.
 *
 * The table is locked for writing first: that lock takes in the
 * invalidations of DDL committed since the transaction's last look at the
 * table (a trigger just created), so that the catalog judged is the one
 * the write meets.  The saved identity is kept on the caller's stack, so
 * that a section opened inside another one (a trigger on the table that
 * calls these functions) restores what its own caller had.  An ERROR in
 * between is cleaned up by transaction (or subtransaction) abort, which
 * also unwinds the GUC nest level.
 */
static void
write_section_begin(WriteSection *section)
{
	const IdemCatalog *catalog = idem_catalog();

	LockRelationOid(catalog->keys, RowExclusiveLock);
	catalog = idem_catalog();
	if (catalog->deferred_trigger)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot write idempotency keys while idempotency.keys has a deferrable trigger"),
				 errdetail("A deferred trigger fires at commit, outside the write, where it cannot run with the restrictions the table owner's rights need."),
				 errhint("Make the trigger NOT DEFERRABLE, or drop it.")));
	if (catalog->user_code && write_caller_has_temp_objects())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot write idempotency keys while this session has temporary objects"),
				 errdetail("idempotency.keys has triggers, rules, row security, constraints or index expressions, which run with its owner's rights, and PostgreSQL looks table and type names up in the session's temporary schema whatever search_path says."),
				 errhint("Drop this session's temporary tables and types (DISCARD TEMP), or call the function from a session without them.")));
	GetUserIdAndSecContext(&section->saved_userid, &section->saved_sec_context);
	SetUserIdAndSecContext(catalog->owner, section->saved_sec_context |
						   SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);

	/*
	 * A shard's catalog is the one its transaction selected, which an index
	 * created on the shard since does not reach: on a shard the section is
	 * pinned whatever it says.
	 */
	section->user_code = catalog->user_code || catalog->shardid != 0;
	section->guc_nestlevel = 0;
	if (section->user_code)
		write_section_pin(section);
}

/*
 * Whatever the section's code set (even with SET or set_config(..., false))
 * ends with it, as in PostgreSQL's own restricted sections.
 */
static void
write_section_end(WriteSection *section)
{
	if (section->guc_nestlevel != 0)
		AtEOXact_GUC(false, section->guc_nestlevel);
	SetUserIdAndSecContext(section->saved_userid, section->saved_sec_context);
}

/*
 * The statement of a rule: $1 is the row's ctid (an insert has none), then
 * one parameter per column the rule sets, in table order.  Every object and
 * operator is schema-qualified, so the caller's search_path never matters.
 */
static char *
write_rule_sql(const WriteRule *rule, Oid *argtypes, int *nargs)
{
	StringInfoData sql;
	StringInfoData vals;
	const char *sep = "";
	uint32		columns = write_columns(rule);

	initStringInfo(&sql);
	initStringInfo(&vals);
	*nargs = 0;
	if (rule->cmd != CMD_INSERT)
		argtypes[(*nargs)++] = TIDOID;
	switch (rule->cmd)
	{
		case CMD_INSERT:
			appendStringInfoString(&sql, "INSERT INTO idempotency.keys (");
			break;
		case CMD_UPDATE:
			appendStringInfoString(&sql, "UPDATE idempotency.keys SET ");
			break;
		default:
			appendStringInfoString(&sql, "DELETE FROM idempotency.keys");
			break;
	}
	for (int i = 0; i < KEYS_NCOLS; i++)
	{
		const char *name = quote_identifier(idem_keys_columns[i].name);

		if (!(columns & KEYS_COL_BIT(i + 1)))
			continue;
		argtypes[(*nargs)++] = idem_keys_columns[i].type;
		if (rule->cmd == CMD_INSERT)
		{
			appendStringInfo(&sql, "%s%s", sep, name);
			appendStringInfo(&vals, "%s$%d", sep, *nargs);
		}
		else
			appendStringInfo(&sql, "%s%s = $%d", sep, name, *nargs);
		sep = ", ";
	}
	if (rule->cmd == CMD_INSERT)
		appendStringInfo(&sql, ") VALUES (%s)", vals.data);
	else
	{
		appendStringInfoString(&sql, " WHERE ctid OPERATOR(pg_catalog.=) $1");
		/* the row is locked in the mode of the write (direct.c) */
		if (rule->skip_busy)
			appendStringInfo(&sql,
							 " AND ctid OPERATOR(pg_catalog.=) ("
							 "SELECT ctid FROM idempotency.keys "
							 "WHERE ctid OPERATOR(pg_catalog.=) $1 "
							 "FOR %s SKIP LOCKED)",
							 rule->cmd == CMD_UPDATE &&
							 (columns & idem_catalog()->key_columns) == 0 ?
							 "NO KEY UPDATE" : "UPDATE");
	}
	pfree(vals.data);
	return sql.data;
}

/* Prepare (once per backend) and return the statement of a kind of write. */
static SPIPlanPtr
write_plan(WriteKind kind)
{
	int			ncols = idem_catalog()->ncols;
	uint32		key_columns = idem_catalog()->key_columns;

	if (write_plans_ncols != ncols || write_plans_key_columns != key_columns)
	{
		for (int i = 0; i < NUM_WRITE_KINDS; i++)
		{
			if (write_plans[i] != NULL)
				SPI_freeplan(write_plans[i]);
			write_plans[i] = NULL;
		}
		write_plans_ncols = ncols;
		write_plans_key_columns = key_columns;
	}
	if (write_plans[kind] == NULL)
	{
		Oid			argtypes[KEYS_NCOLS + 1];
		int			nargs;
		char	   *sql = write_rule_sql(&write_rules[kind], argtypes, &nargs);
		SPIPlanPtr	plan;

		plan = SPI_prepare_cursor(sql, nargs, argtypes, CURSOR_OPT_GENERIC_PLAN);
		if (plan == NULL)
			elog(ERROR, "could not prepare idempotency statement \"%s\": %s",
				 sql, SPI_result_code_string(SPI_result));
		if (SPI_keepplan(plan) != 0)
			elog(ERROR, "could not keep idempotency statement \"%s\"", sql);
		pfree(sql);
		write_plans[kind] = plan;
	}
	return write_plans[kind];
}

/*
 * Execute one of the prepared statements (each addresses its row by ctid).
 * Its generic plan is built at the first execution (and again after an
 * invalidation); if the table looks empty to the planner then (freshly
 * vacuumed), a Seq Scan costs nothing and would be kept for every later
 * call on a growing table.  So seq scans are disabled while the statement
 * runs (and may be planned), the way a function's SET clause does it: in a
 * GUC nesting level of its own, so that a trigger on the table that
 * changes the setting (SET LOCAL) inside the statement is unwound with it,
 * and an ERROR unwinds it with the (sub)transaction.  Returns the rows it
 * wrote.
 */
static uint64
write_execute(WriteKind kind, const WriteRow *row)
{
	const WriteRule *rule = &write_rules[kind];
	SPIPlanPtr	plan = write_plan(kind);
	uint32		columns = write_columns(rule);
	Datum		values[KEYS_NCOLS + 1];
	char		nulls[KEYS_NCOLS + 1];
	int			nargs = 0;
	int			save_nestlevel;
	int			rc;

	if (rule->cmd != CMD_INSERT)
	{
		values[nargs] = PointerGetDatum(&row->tid);
		nulls[nargs++] = ' ';
	}
	for (int i = 0; i < KEYS_NCOLS; i++)
	{
		if (!(columns & KEYS_COL_BIT(i + 1)))
			continue;
		values[nargs] = row->values[i];
		nulls[nargs++] = row->nulls[i] ? 'n' : ' ';
	}

	save_nestlevel = NewGUCNestLevel();
	(void) set_config_option("enable_seqscan", "off", PGC_USERSET,
							 PGC_S_SESSION, GUC_ACTION_SAVE, true, 0, false);
	rc = SPI_execute_plan(plan, values, nulls, false, 0);
	AtEOXact_GUC(false, save_nestlevel);
	if (rc != (rule->cmd == CMD_INSERT ? SPI_OK_INSERT :
			   rule->cmd == CMD_UPDATE ? SPI_OK_UPDATE : SPI_OK_DELETE))
		elog(ERROR, "idempotency statement failed: %s",
			 SPI_result_code_string(rc));
	return SPI_processed;
}

/*
 * A write found fewer rows than it probed under their locks: under
 * REPEATABLE READ or SERIALIZABLE the statement's snapshot predates a
 * concurrent change (a serialization failure); otherwise only a change by
 * plain SQL outside the extension's functions can cause it.
 */
static void
write_raise_vanished(void)
{
	if (IsolationUsesXactSnapshot())
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("could not serialize access due to concurrent update of an idempotency key"),
				 errhint("Retry the transaction.")));
	ereport(ERROR,
			(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
			 errmsg("idempotency key changed during a write"),
			 errdetail("Someone changed idempotency.keys outside the extension's functions."),
			 errhint("Retry the transaction.")));
}

/*
 * Run a sweep rule's statement for one row under REPEATABLE READ or
 * SERIALIZABLE.  There, locking a row that was changed after the
 * transaction's snapshot raises a serialization failure instead of
 * skipping the row, so the statement runs in a subtransaction and that
 * failure counts as a skipped row, as it does on the direct path.  Any
 * other error propagates.
 */
static uint64
write_execute_skipping(WriteKind kind, const WriteRow *row)
{
	MemoryContext cxt = CurrentMemoryContext;
	ResourceOwner owner = CurrentResourceOwner;
	volatile uint64 written = 0;

	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(cxt);
	PG_TRY();
	{
		written = write_execute(kind, row);
		ReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(cxt);
		CurrentResourceOwner = owner;
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		/*
		 * The subtransaction ends here whatever the error: one left open
		 * would outlive the caller's exception handler or ROLLBACK.  The
		 * error is copied out of it first and raised again after.
		 */
		MemoryContextSwitchTo(cxt);
		edata = CopyErrorData();
		FlushErrorState();
		RollbackAndReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(cxt);
		CurrentResourceOwner = owner;
		if (edata->sqlerrcode != ERRCODE_T_R_SERIALIZATION_FAILURE)
			ReThrowError(edata);
		FreeErrorData(edata);
	}
	PG_END_TRY();
	return written;
}

/*
 * Write one row directly, setting "columns" (the rule's that the table
 * has); false when it was skipped (a sweep's rule).
 */
static bool
write_direct(IdemDirect *direct, const WriteRule *rule, uint32 columns,
			 WriteRow *row)
{
	IdemDirectResult result;

	switch (rule->cmd)
	{
		case CMD_INSERT:
			idem_direct_insert(direct, row->values, row->nulls);
			return true;
		case CMD_UPDATE:
			result = idem_direct_update(direct, &row->tid, columns,
										row->values, row->nulls,
										!rule->skip_busy);
			break;
		default:
			result = idem_direct_delete(direct, &row->tid, !rule->skip_busy);
			break;
	}
	return result == IDEM_DIRECT_DONE;
}

/*
 * Apply the write "kind" to "n" rows, directly when the table allows, else
 * by its statement; returns how many it wrote, and, with "done", which.  A
 * row that is not written is skipped under a sweep's rule, and an error
 * under any other.
 */
static int
write_apply(WriteKind kind, WriteRow *rows, int n, bool *done_rows)
{
	const WriteRule *rule = &write_rules[kind];
	WriteSection section;
	IdemDirect	direct;
	int			done = 0;

	for (int i = 0; done_rows && i < n; i++)
		done_rows[i] = true;
	write_section_begin(&section);
	if (idem_direct_begin(&direct))
	{
		uint32		columns = write_columns(rule);

		for (int i = 0; i < n; i++)
		{
			CHECK_FOR_INTERRUPTS();
			if (section.user_code)
				write_section_pin(&section);
			if (write_direct(&direct, rule, columns, &rows[i]))
				done++;
			else if (!rule->skip_busy)
				write_raise_vanished();
			else if (done_rows)
				done_rows[i] = false;
		}
		idem_direct_end(&direct);
	}
	else
	{
		/*
		 * The statements name idempotency.keys, which on a distributed table
		 * means every shard: a write by ctid would reach other scopes' rows.
		 */
		if (idem_catalog()->shardid != 0)
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("the shards of idempotency.keys have triggers, rules or row security"),
					 errdetail("When Citus distributes idempotency.keys the extension writes a scope's shard directly, which would bypass them."),
					 errhint("Drop them from idempotency.keys.")));
		if (SPI_connect() != SPI_OK_CONNECT)
			elog(ERROR, "SPI_connect failed");
		for (int i = 0; i < n; i++)
		{
			uint64		written;

			CHECK_FOR_INTERRUPTS();
			write_section_pin(&section);
			if (rule->skip_busy && IsolationUsesXactSnapshot())
				written = write_execute_skipping(kind, &rows[i]);
			else
				written = write_execute(kind, &rows[i]);
			if (written == 1)
				done++;
			else if (!rule->skip_busy)
				write_raise_vanished();
			else if (done_rows)
				done_rows[i] = false;
		}
		if (SPI_finish() != SPI_OK_FINISH)
			elog(ERROR, "SPI_finish failed");
	}
	write_section_end(&section);
	return done;
}

static void
write_set(WriteRow *row, KeysColumn col, Datum value)
{
	row->values[col - 1] = value;
	row->nulls[col - 1] = false;
}

static void
write_set_null(WriteRow *row, KeysColumn col)
{
	row->values[col - 1] = (Datum) 0;
	row->nulls[col - 1] = true;
}

/* A new write of the row version "tid" (NULL for an insert). */
static void
write_row_begin(WriteRow *row, const ItemPointerData *tid)
{
	memset(row, 0, sizeof(WriteRow));
	if (tid != NULL)
		row->tid = *tid;
}

/* A bytea fingerprint column, or NULL. */
static void
write_set_fingerprint(WriteRow *row, const uint8 *fingerprint)
{
	bytea	   *b;

	if (fingerprint == NULL)
	{
		write_set_null(row, KEYS_COL_FINGERPRINT);
		return;
	}
	b = palloc(VARHDRSZ + IDEM_FINGERPRINT_LEN);
	SET_VARSIZE(b, VARHDRSZ + IDEM_FINGERPRINT_LEN);
	memcpy(VARDATA(b), fingerprint, IDEM_FINGERPRINT_LEN);
	write_set(row, KEYS_COL_FINGERPRINT, PointerGetDatum(b));
}

/* The remember column: the time to remember the key, or NULL (not). */
static void
write_set_remember(WriteRow *row, Interval *remember)
{
	if (remember != NULL)
		write_set(row, KEYS_COL_REMEMBER, IntervalPGetDatum(remember));
	else
		write_set_null(row, KEYS_COL_REMEMBER);
}

/*
 * The sweep_at of an existing row that a write makes due at "due": never
 * later than it was.  The sweeper finds a row whose sweep_at passed before
 * its time and moves it forward then; leaving sweep_at where it is, when
 * that is earlier, keeps the write a HOT update (sweep_at is indexed).
 */
static TimestampTz
write_sweep_at(const IdemRow *row, TimestampTz due)
{
	return Min(row->sweep_at, due);
}

/*
 * The columns of a new pending attempt, whether inserted or taking a row
 * over.
 */
static void
write_set_pending_attempt(WriteRow *row, int64 token, int32 attempt,
						  const uint8 *fingerprint, TimestampTz created_at,
						  TimestampTz lease_until, TimestampTz expires_at,
						  Interval *retention, TimestampTz sweep_at, int64 owner_session,
						  Interval *remember, Datum request)
{
	write_set(row, KEYS_COL_STATUS, CStringGetTextDatum(idem_status_names[IDEM_PENDING]));
	write_set(row, KEYS_COL_TOKEN, Int64GetDatum(token));
	write_set(row, KEYS_COL_ATTEMPT, Int32GetDatum(attempt));
	write_set_fingerprint(row, fingerprint);
	write_set_null(row, KEYS_COL_RESPONSE_CODE);
	write_set_null(row, KEYS_COL_RESPONSE_BODY);
	write_set(row, KEYS_COL_CREATED_AT, TimestampTzGetDatum(created_at));
	write_set_null(row, KEYS_COL_FINISHED_AT);
	write_set(row, KEYS_COL_LEASE_UNTIL, TimestampTzGetDatum(lease_until));
	write_set(row, KEYS_COL_EXPIRES_AT, TimestampTzGetDatum(expires_at));
	write_set(row, KEYS_COL_RETENTION, IntervalPGetDatum(retention));
	write_set(row, KEYS_COL_SWEEP_AT, TimestampTzGetDatum(sweep_at));
	write_set_null(row, KEYS_COL_PHASE);
	write_set_null(row, KEYS_COL_PHASE_DATA);
	if (owner_session != 0)
		write_set(row, KEYS_COL_OWNER_SESSION, Int64GetDatum(owner_session));
	else
		write_set_null(row, KEYS_COL_OWNER_SESSION);
	write_set_remember(row, remember);
	if (request != (Datum) 0)
		write_set(row, KEYS_COL_REQUEST, request);
	else
		write_set_null(row, KEYS_COL_REQUEST);
}

/* Insert a new pending key (first attempt). */
void
idem_write_insert_claim(text *scope, text *key, int64 token,
						const uint8 *fingerprint, TimestampTz now,
						TimestampTz lease_until, TimestampTz expires_at,
						Interval *retention, int64 owner_session,
						Interval *remember, Datum request)
{
	WriteRow	row;

	write_row_begin(&row, NULL);
	write_set(&row, KEYS_COL_SCOPE, PointerGetDatum(scope));
	write_set(&row, KEYS_COL_KEY, PointerGetDatum(key));
	write_set_pending_attempt(&row, token, 1, fingerprint, now, lease_until, expires_at,
							  retention, lease_until, owner_session, remember,
							  request);
	(void) write_apply(WRITE_CLAIM_INSERT, &row, 1, NULL);
}

/*
 * Turn the probed row into a new pending attempt: a takeover (attempt + 1,
 * which keeps the last checkpoint, and the kept request unless "request"
 * replaces it) or a fresh claim over a row past its retention (attempt 1,
 * which clears both; "request" is kept, or 0).  owner_session is the
 * claiming session's binding, or 0.
 */
void
idem_write_update_claim(const IdemRow *old, int64 token, int32 attempt,
						const uint8 *fingerprint, TimestampTz created_at,
						TimestampTz lease_until, TimestampTz expires_at,
						Interval *retention, int64 owner_session,
						Interval *remember, Datum request)
{
	WriteRow	row;

	write_row_begin(&row, &old->tid);
	write_set_pending_attempt(&row, token, attempt, fingerprint, created_at, lease_until,
							  expires_at, retention, write_sweep_at(old, lease_until),
							  owner_session, remember, request);
	(void) write_apply(attempt == 1 ? WRITE_CLAIM_RENEW :
					   request != (Datum) 0 ? WRITE_CLAIM_TAKEOVER_REQUEST :
					   WRITE_CLAIM_TAKEOVER, &row, 1, NULL);
}

/* Store the result of the probed pending row. */
void
idem_write_finish(const IdemRow *old, IdemStatus status, bool has_code,
				  int32 code, Datum body, TimestampTz now,
				  TimestampTz expires_at, Interval *remember)
{
	WriteRow	row;

	write_row_begin(&row, &old->tid);
	write_set(&row, KEYS_COL_STATUS, CStringGetTextDatum(idem_status_names[status]));
	if (has_code)
		write_set(&row, KEYS_COL_RESPONSE_CODE, Int32GetDatum(code));
	else
		write_set_null(&row, KEYS_COL_RESPONSE_CODE);
	if (body != (Datum) 0)
		write_set(&row, KEYS_COL_RESPONSE_BODY, body);
	else
		write_set_null(&row, KEYS_COL_RESPONSE_BODY);
	write_set(&row, KEYS_COL_FINISHED_AT, TimestampTzGetDatum(now));
	write_set_null(&row, KEYS_COL_LEASE_UNTIL);
	write_set(&row, KEYS_COL_EXPIRES_AT, TimestampTzGetDatum(expires_at));
	write_set(&row, KEYS_COL_SWEEP_AT,
			  TimestampTzGetDatum(write_sweep_at(old, expires_at)));
	write_set_null(&row, KEYS_COL_OWNER_SESSION);
	write_set_remember(&row, remember);
	write_set_null(&row, KEYS_COL_REQUEST);
	(void) write_apply(WRITE_FINISH, &row, 1, NULL);
}

/*
 * Record a checkpoint (phase, and data or 0 for NULL) on the probed row.
 * A table of a version before 1.4 has nowhere to keep it.
 */
void
idem_write_checkpoint(const IdemRow *old, Datum phase, Datum data)
{
	WriteRow	row;

	if (idem_catalog()->ncols < KEYS_COL_PHASE_DATA)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency.keys has no checkpoint columns"),
				 errhint("Run ALTER EXTENSION idempotency UPDATE.")));
	write_row_begin(&row, &old->tid);
	write_set(&row, KEYS_COL_PHASE, phase);
	if (data != (Datum) 0)
		write_set(&row, KEYS_COL_PHASE_DATA, data);
	else
		write_set_null(&row, KEYS_COL_PHASE_DATA);
	(void) write_apply(WRITE_CHECKPOINT, &row, 1, NULL);
}

/* Push the lease (and the pending expiry) of the probed row. */
void
idem_write_extend(const IdemRow *old, TimestampTz lease_until,
				  TimestampTz expires_at)
{
	WriteRow	row;

	write_row_begin(&row, &old->tid);
	write_set(&row, KEYS_COL_LEASE_UNTIL, TimestampTzGetDatum(lease_until));
	write_set(&row, KEYS_COL_EXPIRES_AT, TimestampTzGetDatum(expires_at));
	(void) write_apply(WRITE_EXTEND, &row, 1, NULL);
}

/* Delete the probed row. */
void
idem_write_release(const IdemRow *old)
{
	WriteRow	row;

	write_row_begin(&row, &old->tid);
	(void) write_apply(WRITE_RELEASE, &row, 1, NULL);
}

/*
 * Apply one kind of sweep work to "n" rows (each locked by the caller and
 * re-read at exactly this version): delete them, reset them (their tokens
 * die), move their sweep_at, or compact them (a remembered key's response
 * and recovery point go); every kind but a delete sets each row's sweep_at
 * to the item's.  A row changed or locked by plain SQL since is
 * skipped.  Returns how many rows it changed.
 */
int
idem_write_sweep(IdemSweepWork work, IdemSweepItem *items, int n)
{
	static const WriteKind kinds[IDEM_SWEEP_NKINDS] = {
		[IDEM_SWEEP_DELETE] = WRITE_SWEEP_DELETE,
		[IDEM_SWEEP_RESET] = WRITE_SWEEP_RESET,
		[IDEM_SWEEP_RESCHEDULE] = WRITE_SWEEP_RESCHEDULE,
		[IDEM_SWEEP_COMPACT] = WRITE_SWEEP_COMPACT,
	};
	WriteRow   *rows;
	bool	   *done_rows;
	int			done;

	if (n == 0)
		return 0;
	rows = palloc(sizeof(WriteRow) * n);
	done_rows = palloc(sizeof(bool) * n);
	for (int i = 0; i < n; i++)
	{
		write_row_begin(&rows[i], &items[i].tid);
		write_set_null(&rows[i], KEYS_COL_TOKEN);
		write_set(&rows[i], KEYS_COL_SWEEP_AT, TimestampTzGetDatum(items[i].sweep_at));
		write_set_null(&rows[i], KEYS_COL_OWNER_SESSION);
		write_set_null(&rows[i], KEYS_COL_RESPONSE_BODY);
		write_set_null(&rows[i], KEYS_COL_PHASE);
		write_set_null(&rows[i], KEYS_COL_PHASE_DATA);
		write_set_null(&rows[i], KEYS_COL_REQUEST);
	}
	done = write_apply(kinds[work], rows, n, done_rows);
	for (int i = 0; i < n; i++)
		items[i].done = done_rows[i];
	pfree(done_rows);
	pfree(rows);
	return done;
}
