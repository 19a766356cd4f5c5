/*-------------------------------------------------------------------------
 *
 * args.h
 *	  Reading and checking the SQL functions' arguments (args.c).
 *
 * Each .c file includes postgres.h first, then this.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_ARGS_H
#define IDEM_ARGS_H

#include "datatype/timestamp.h"
#include "fmgr.h"

#include "idempotency.h"

/* A batch's array argument, taken apart. */
typedef struct BatchArray
{
	bool		given;			/* false: the argument is NULL */
	int			n;
	Datum	   *elems;
	bool	   *nulls;
} BatchArray;

/* Single arguments: each raises its documented SQLSTATE. */
extern void idem_arg_not_null(FunctionCallInfo fcinfo, int argno,
							  const char *name);
extern void idem_check_name(text *t, const char *name, bool allow_empty);
extern text *idem_arg_name(FunctionCallInfo fcinfo, int argno,
						   const char *name, bool allow_empty);
extern Interval *idem_arg_interval(FunctionCallInfo fcinfo, int argno);
extern void idem_check_positive(Interval *iv, const char *name);
extern bool idem_arg_remember(FunctionCallInfo fcinfo, int argno,
							  Interval **remember);
extern Interval *idem_remember_setting(void);
extern int64 idem_arg_wait(FunctionCallInfo fcinfo, int argno);
extern IdemStatus idem_arg_status(FunctionCallInfo fcinfo, int argno);
extern void idem_check_body_size(Datum body, const char *name);
extern Datum idem_arg_body(FunctionCallInfo fcinfo, int argno,
						   const char *name);
extern void idem_check_writable(const char *function);

/* Batch arrays. */
extern void idem_arg_array(FunctionCallInfo fcinfo, int argno,
						   const char *name, bool required, Oid elemtype,
						   BatchArray *out);
extern void idem_check_batch_length(const BatchArray *a, const char *name,
									int n);
extern void idem_check_batch_keys(const BatchArray *keys);

/* Intervals as leases and retentions use them. */
extern Interval *idem_interval_from_ms(int64 ms);
extern TimestampTz idem_add_interval(TimestampTz now, Interval *iv);

/* The result rows of a set-returning function. */
extern void idem_result_init(FunctionCallInfo fcinfo);

#endif							/* IDEM_ARGS_H */
