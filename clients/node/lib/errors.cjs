'use strict';
/*
 * The errors pg-idempotency throws, all subclasses of IdempotencyError.  They
 * live in a module of their own, required by whichever file throws them, so
 * the job API, the HTTP engine and both entry points share one set of
 * classes and instanceof holds wherever an error is caught.
 */

class IdempotencyError extends Error {
	constructor(message, options) {
		super(message, options);
		this.name = new.target.name;
	}
}

/* another attempt holds a live claim on the key */
class InProgressError extends IdempotencyError {
	constructor(key, retryAfter) {
		super(`idempotency key ${JSON.stringify(key)} is in use by another attempt; ` +
			`retry in ${retryAfter} s`);
		this.key = key;
		this.retryAfter = retryAfter;
	}
}

/* the key was used before with a different request payload */
class MismatchError extends IdempotencyError {
	constructor(key) {
		super(`idempotency key ${JSON.stringify(key)} was used with a different request`);
		this.key = key;
	}
}

/*
 * The key was used before and its result has expired, but the server still
 * remembers that it was (the claim's remember option, or the server's
 * idempotency.remember): the work ran, with that status, and is not run
 * again.  responseCode is the stored HTTP status, null for a job's key.
 */
class ExpiredError extends IdempotencyError {
	constructor(key, { scope = '', status, responseCode = null } = {}) {
		super(`idempotency key ${JSON.stringify(key)} was already used (it ${status}); its stored ` +
			'result has expired, and the work is not run again');
		this.key = key;
		this.scope = scope;
		this.status = status;
		this.responseCode = responseCode;
	}
}

/* the key's stored result is a failure: the replay of a job that failed for good */
class StoredFailureError extends IdempotencyError {
	constructor(key, stored) {
		super(`idempotency key ${JSON.stringify(key)} holds a stored failure: ` +
			`${stored?.name ?? 'Error'}: ${stored?.message ?? ''}`);
		this.key = key;
		this.stored = { name: String(stored?.name ?? 'Error'), message: String(stored?.message ?? '') };
	}
}

/*
 * This attempt no longer owns the key: its lease ran out and another attempt
 * took the key over (or it was settled or removed meanwhile).  Its result was
 * not stored.
 */
class KeyLostError extends IdempotencyError {
	constructor(key, options) {
		super(`idempotency key ${JSON.stringify(key)} was lost: another attempt took it ` +
			'over after the lease ran out; this result was not stored', options);
		this.key = key;
	}
}

/*
 * The idempotency store cannot work as configured (no extension, an old
 * one, no permission, a closed pool): retrying does not help, the message
 * says what to fix.
 */
class MisconfiguredError extends IdempotencyError {}

module.exports = {
	IdempotencyError, InProgressError, MismatchError, ExpiredError, StoredFailureError, KeyLostError,
	MisconfiguredError,
};
