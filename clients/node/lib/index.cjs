'use strict';
/*
 * pg-idempotency: idempotency keys for node-postgres on top of the idempotency
 * PostgreSQL extension.  The database holds every key's state; this package maps
 * the extension's five claim outcomes onto jobs (idempotent(), idempotentJob()) and onto HTTP
 * (an Express middleware and a Fastify plugin):
 *
 *   claimed      run the work, keep the lease alive, then idem_finish or idem_release
 *   replay       the stored result, without running the work
 *   in_progress  someone else holds the key: 409 + Retry-After / InProgressError
 *   mismatch     same key, different request: 422 / MismatchError
 *   expired      the work ran, its result is gone, the server remembers the key:
 *                410 / ExpiredError (extension 1.7, the remember option)
 *
 * Every call is one autocommit statement on whatever pool connection is free
 * (no session state spans claim and finish), so it works through PgBouncer in
 * transaction pooling mode; the transactional HTTP mode holds one connection
 * for its BEGIN ... COMMIT, as any transaction does, and a session-bound job
 * (sessionBound) holds the connection of its claim until it settles.
 *
 * Recovery points: the attempt's checkpoint(phase, data) records a completed
 * step with idem_checkpoint; an attempt that takes the key over gets it back
 * as phase and phaseData, and resumes after that step.
 *
 * Completers (extension 1.8): a key claimed with keepRequest stores its
 * request; completer() takes over the keys of a scope whose attempt died
 * (idem_claim_abandoned, woken by the sweep's NOTIFY) and runs the job's
 * handler from the last recovery point with that request.
 *
 * The files, one job each; this one only assembles the public API:
 *
 *   errors.cjs     the error classes the application catches
 *   core.cjs       what jobs and HTTP share: the statements, SQLSTATEs, the
 *                  extension's version and settings, and a claimed attempt's
 *                  lease, checkpoints, finish and release
 *   jobs.cjs       idempotent(), idempotentJob(), currentJob()
 *   header.cjs     the Idempotency-Key header
 *   bodies.cjs     request and response bodies as bytes, and their framing
 *   cache.cjs      the optional in-process cache of finished results
 *   http.cjs       the HTTP engine: claim, replay, problems, the store policy
 *   express.cjs    the Express middleware and the rawBody verify hook
 *   fastify.cjs    the Fastify plugin
 *   completer.cjs  completer(): abandoned keys finished from their recovery point
 */

const {
	IdempotencyError, InProgressError, MismatchError, ExpiredError, StoredFailureError, KeyLostError,
	MisconfiguredError,
} = require('./errors.cjs');
const { idempotent, idempotentJob, currentJob } = require('./jobs.cjs');
const { MAX_KEY_LENGTH, parseIdempotencyKey } = require('./header.cjs');
const { PROBLEMS, defaultStorePolicy, idempotencyContext } = require('./http.cjs');
const { expressIdempotency, rawBody } = require('./express.cjs');
const { fastifyIdempotency } = require('./fastify.cjs');
const { completer } = require('./completer.cjs');

module.exports = {
	idempotent,
	idempotentJob,
	currentJob,
	completer,
	expressIdempotency,
	fastifyIdempotency,
	rawBody,
	idempotencyContext,
	parseIdempotencyKey,
	defaultStorePolicy,
	IdempotencyError,
	InProgressError,
	MismatchError,
	ExpiredError,
	StoredFailureError,
	KeyLostError,
	MisconfiguredError,
	MAX_KEY_LENGTH,
	PROBLEMS,
};
