/*-------------------------------------------------------------------------
 *
 * compat.h
 *	  Every difference between the PostgreSQL versions the extension
 *	  builds against (15 to 18), in one place.
 *
 * The .c files use the names defined here and carry no version tests of
 * their own.  Each entry says which version changed what.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_COMPAT_H
#define IDEMPOTENCY_COMPAT_H

#include "access/genam.h"
#include "access/tableam.h"
#include "executor/executor.h"
#include "storage/proc.h"

#if PG_VERSION_NUM < 150000
#error "idempotency needs PostgreSQL 15 or later"
#endif

/*
 * 16: table_tuple_update reports which indexes need new entries
 * (TU_UpdateIndexes, with "summarizing only" for BRIN), and
 * ExecInsertIndexTuples takes that flag.  15 reports a plain bool.
 */
#if PG_VERSION_NUM >= 160000
typedef TU_UpdateIndexes IdemUpdateIndexes;
#define IDEM_UPDATE_NEEDS_INDEXES(u)		((u) != TU_None)
#define IDEM_UPDATE_ONLY_SUMMARIZING(u)	((u) == TU_Summarizing)
#define idem_insert_index_tuples(rri, slot, estate, update, only_summarizing) \
	ExecInsertIndexTuples((rri), (slot), (estate), (update), false, NULL, NIL, \
						  (only_summarizing))
#else
typedef bool IdemUpdateIndexes;
#define IDEM_UPDATE_NEEDS_INDEXES(u)		(u)
#define IDEM_UPDATE_ONLY_SUMMARIZING(u)	false
#define idem_insert_index_tuples(rri, slot, estate, update, only_summarizing) \
	ExecInsertIndexTuples((rri), (slot), (estate), (update), false, NULL, NIL)
#endif

/*
 * 17: a backend's slot in the PGPROC array is MyProcNumber; before, it was
 * MyProc->pgprocno.  Both index the same array.
 */
#if PG_VERSION_NUM >= 170000
#define IDEM_MY_PROC_NUMBER			MyProcNumber
#else
#define IDEM_MY_PROC_NUMBER			(MyProc->pgprocno)
#endif

/*
 * 17: a backend's local transaction id moved into MyProc->vxid; before, it
 * was MyProc->lxid.
 */
#if PG_VERSION_NUM >= 170000
#define IDEM_MY_LXID				(MyProc->vxid.lxid)
#else
#define IDEM_MY_LXID				(MyProc->lxid)
#endif

/*
 * 17: LockHeldByMe takes a third argument, whether a stronger mode counts;
 * before, only the exact mode did, which is what the exact test here asks.
 */
#if PG_VERSION_NUM >= 170000
#define idem_lock_held_by_me(tag, mode)	LockHeldByMe((tag), (mode), false)
#else
#define idem_lock_held_by_me(tag, mode)	LockHeldByMe((tag), (mode))
#endif

/*
 * 18: pg_noreturn, written before a declaration, replaces
 * pg_attribute_noreturn(), written after it.  GCC and clang accept the old
 * attribute before the declaration too, so IDEM_NORETURN goes first on
 * every version.
 */
#if PG_VERSION_NUM >= 180000
#define IDEM_NORETURN				pg_noreturn
#else
#define IDEM_NORETURN				pg_attribute_noreturn()
#endif

/* 18: index_beginscan takes an instrumentation struct (none here). */
#if PG_VERSION_NUM >= 180000
#define idem_index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan((heap), (index), (snapshot), NULL, (nkeys), (norderbys))
#else
#define idem_index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan((heap), (index), (snapshot), (nkeys), (norderbys))
#endif

/*
 * 18: a module can tell its name and version, which pg_get_loaded_modules()
 * shows; before, the magic block carries neither.
 */
#if PG_VERSION_NUM >= 180000
#define IDEM_MODULE_MAGIC \
	PG_MODULE_MAGIC_EXT(.name = "idempotency", .version = IDEM_VERSION)
#else
#define IDEM_MODULE_MAGIC			PG_MODULE_MAGIC
#endif

/*
 * Minor releases of May 2025 (17.5, 16.9, 15.13): WalSndCtl's one byte
 * saying whether synchronous standbys are defined became flags, one of
 * them saying whether the checkpointer set the state up yet; the field
 * kept its place and size.  The headers name it one way or the other; the
 * running server's version tells which meaning it has (write.c).
 */
#if PG_VERSION_NUM >= 170005 || \
	(PG_VERSION_NUM >= 160009 && PG_VERSION_NUM < 170000) || \
	(PG_VERSION_NUM >= 150013 && PG_VERSION_NUM < 160000)
#define IDEM_SYNC_STANDBYS_FIELD(ctl)	((uint8) (ctl)->sync_standbys_status)
#else
#define IDEM_SYNC_STANDBYS_FIELD(ctl)	((uint8) (ctl)->sync_standbys_defined)
#endif
#define IDEM_SYNC_STANDBY_INIT			(1 << 0)
#define IDEM_SYNC_STANDBY_DEFINED		(1 << 1)

#endif							/* IDEMPOTENCY_COMPAT_H */
