'use strict';
/*
 * Crashes and pauses in external-call mode.  The external call is at least
 * once: a service killed after the processor charged but before idem_finish
 * leaves a pending key; after its lease the retry takes the key over (attempt
 * 2, a larger fencing token) and calls the processor again, which dedupes by
 * key.  A service that is paused (GC pause, SIGSTOP) past its lease is fenced
 * off: the processor refuses its smaller token and its finish fails.
 */

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { createDownstream } = require('../src/downstream');
const {
	db, startService, post, json, lookup, newKey, retryUntilSettled,
} = require('./helpers');

let downstream;
let downstreamUrl;
let survivor;          /* a second service instance that stays up */

before(async () => {
	downstream = createDownstream();
	downstreamUrl = await downstream.listen();
	survivor = await startService(downstreamUrl);
});

after(async () => {
	await survivor?.stop();
	await downstream?.close();
	await db.end();
});

const payment = { amount: 4200, currency: 'EUR' };

test('service SIGKILLed after the charge: the retry after the lease takes over and the processor charges once', async () => {
	const key = newKey('kill');
	const dkey = downstream.keyFor(key);
	const victim = await startService(downstreamUrl);

	/* the processor charges, then holds its answer: the service is mid-request */
	const hold = downstream.hold(dkey, 'after');
	const inFlight = post(victim.url, '/payments', payment, { 'Idempotency-Key': key })
		.then(() => 'answered', (err) => err);
	await hold.arrived;
	victim.child.kill('SIGKILL');
	assert.equal((await victim.exited).signal, 'SIGKILL');
	const lost = await inFlight;
	assert.ok(lost instanceof Error, 'the client saw the connection die');
	hold.release();

	const crashed = await lookup(key);
	assert.equal(crashed.status, 'pending');
	assert.equal(crashed.attempt, 1);

	/* the client retries (on the other instance), honouring Retry-After */
	const { answer, conflicts } = await retryUntilSettled(
		() => post(survivor.url, '/payments', payment, { 'Idempotency-Key': key }));
	for (const c of conflicts)
		assert.ok(Number(c.headers.get('retry-after')) >= 1);
	assert.equal(answer.status, 201, answer.text);

	const [first, second] = downstream.requestsFor(dkey);
	assert.deepEqual(downstream.requestsFor(dkey).map((r) => r.outcome), ['charged', 'deduplicated']);
	assert.ok(second.token > first.token, 'the takeover passed a larger fencing token');
	assert.equal(downstream.chargeCount(dkey), 1, 'charged exactly once');
	assert.equal(json(answer).charge, downstream.charges.get(dkey).id);

	const settled = await lookup(key);
	assert.equal(settled.status, 'succeeded');
	assert.equal(settled.attempt, 2, 'the retry was a takeover');
	const replay = await post(survivor.url, '/payments', payment, { 'Idempotency-Key': key });
	assert.equal(replay.headers.get('idempotent-replayed'), 'true');
	assert.equal(replay.text, answer.text);
});

test('service paused past its lease: the takeover wins, the old attempt is fenced off', async () => {
	const key = newKey('pause');
	const dkey = downstream.keyFor(key);
	const sleeper = await startService(downstreamUrl);
	try {
		/* the old attempt's call reaches the processor but is parked before charging */
		const hold = downstream.hold(dkey, 'before');
		const oldAttempt = post(sleeper.url, '/payments', payment, { 'Idempotency-Key': key });
		await hold.arrived;
		sleeper.child.kill('SIGSTOP');      /* no heartbeat: its lease runs out */

		const { answer } = await retryUntilSettled(
			() => post(survivor.url, '/payments', payment, { 'Idempotency-Key': key }));
		assert.equal(answer.status, 201, answer.text);
		assert.equal((await lookup(key)).attempt, 2);

		/* now the old attempt's call goes through, then the old service wakes up */
		hold.release();
		sleeper.child.kill('SIGCONT');
		const old = await oldAttempt;
		assert.equal(old.status, 409, old.text);
		assert.ok(json(old).type.endsWith('/idempotency-key-lost'));

		const calls = downstream.requestsFor(dkey);
		assert.deepEqual(calls.map((r) => r.outcome), ['charged', 'stale']);
		assert.ok(calls[1].token < calls[0].token, 'the stale call carried the smaller token');
		assert.equal(downstream.chargeCount(dkey), 1);

		/* the stored result is the takeover's, untouched by the old attempt */
		const settled = await lookup(key);
		assert.equal(settled.status, 'succeeded');
		assert.equal(settled.attempt, 2);
		const replay = await post(survivor.url, '/payments', payment, { 'Idempotency-Key': key });
		assert.equal(replay.text, answer.text);
		assert.equal(replay.headers.get('idempotent-replayed'), 'true');
	} finally {
		sleeper.child.kill('SIGCONT');
		await sleeper.stop();
	}
});
