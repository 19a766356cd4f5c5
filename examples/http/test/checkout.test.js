'use strict';
/*
 * POST /checkout: two steps (charge at the processor, then ship) with a
 * checkpoint after each.  A service killed between the steps leaves a pending
 * key whose checkpoint is 'charge_created'; the retry that takes the key over
 * after the lease (attempt 2) skips the charge (the processor sees one
 * request) and ships once.  The victim is killed where it says it paused (it
 * waits for a line on its stdin there), never after a guessed delay.
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

const order = { amount: 2500, currency: 'EUR' };

async function shipments(key) {
	const { rows } = await db.query(
		'SELECT charge FROM shipments WHERE request_key = $1 ORDER BY id', [key]);
	return rows.map((r) => r.charge);
}

test('checkout: both steps once, the shipment refers to the charge, a replay is identical', async () => {
	const key = newKey('checkout');
	const dkey = `${downstream.keyFor(key)}/charge`;
	const answer = await post(survivor.url, '/checkout', order, { 'Idempotency-Key': key });
	assert.equal(answer.status, 201, answer.text);
	const body = json(answer);
	assert.equal(body.charge, downstream.charges.get(dkey).id);
	assert.deepEqual(await shipments(key), [body.charge]);
	const settled = await lookup(key);
	assert.deepEqual([settled.status, settled.attempt, settled.phase], ['succeeded', 1, 'shipped']);

	const replay = await post(survivor.url, '/checkout', order, { 'Idempotency-Key': key });
	assert.equal(replay.headers.get('idempotent-replayed'), 'true');
	assert.equal(replay.text, answer.text);
	assert.equal(downstream.chargeCount(dkey), 1);
	assert.equal(downstream.requestsFor(dkey).length, 1);
	assert.deepEqual(await shipments(key), [body.charge]);
});

test('service SIGKILLed between charge and shipment: the takeover resumes after the charge', async () => {
	const key = newKey('checkout-kill');
	const dkey = `${downstream.keyFor(key)}/charge`;
	const victim = await startService(downstreamUrl);

	const inFlight = post(victim.url, '/checkout', order,
		{ 'Idempotency-Key': key, 'X-Simulate-Failure': 'pause-after-charge' })
		.then(() => 'answered', (err) => err);
	await victim.waitForLine(new RegExp(`^PAUSED charged ${key}$`));

	/* step 1 is done and recorded; step 2 is not */
	const paused = await lookup(key);
	assert.deepEqual([paused.status, paused.attempt, paused.phase], ['pending', 1, 'charge_created']);
	assert.equal(downstream.chargeCount(dkey), 1);
	assert.deepEqual(await shipments(key), []);

	victim.child.kill('SIGKILL');
	assert.equal((await victim.exited).signal, 'SIGKILL');
	assert.ok((await inFlight) instanceof Error, 'the client saw the connection die');

	/* the client retries on the other instance, honouring Retry-After until the lease ends */
	const { answer, conflicts } = await retryUntilSettled(
		() => post(survivor.url, '/checkout', order, { 'Idempotency-Key': key }));
	assert.equal(answer.status, 201, answer.text);
	for (const c of conflicts)
		assert.ok(Number(c.headers.get('retry-after')) >= 1);
	const body = json(answer);
	const charge = downstream.charges.get(dkey).id;
	assert.equal(body.charge, charge, 'the charge of the first attempt');

	/* the takeover did not call the processor at all, and shipped once */
	assert.deepEqual(downstream.requestsFor(dkey).map((r) => r.outcome), ['charged']);
	assert.deepEqual(await shipments(key), [charge]);
	const settled = await lookup(key);
	assert.deepEqual([settled.status, settled.attempt, settled.phase], ['succeeded', 2, 'shipped']);

	const replay = await post(survivor.url, '/checkout', order, { 'Idempotency-Key': key });
	assert.equal(replay.headers.get('idempotent-replayed'), 'true');
	assert.equal(replay.text, answer.text);
});

test('a paused checkout goes on when told to: one charge, one shipment, attempt 1', async () => {
	const key = newKey('checkout-go');
	const dkey = `${downstream.keyFor(key)}/charge`;
	const service = await startService(downstreamUrl);
	try {
		const inFlight = post(service.url, '/checkout', order,
			{ 'Idempotency-Key': key, 'X-Simulate-Failure': 'pause-after-charge' });
		await service.waitForLine(new RegExp(`^PAUSED charged ${key}$`));
		/* meanwhile a retry is told to come back later */
		const busy = await post(survivor.url, '/checkout', order, { 'Idempotency-Key': key });
		assert.equal(busy.status, 409, busy.text);
		service.child.stdin.write('go\n');
		const answer = await inFlight;
		assert.equal(answer.status, 201, answer.text);
		assert.equal(downstream.chargeCount(dkey), 1);
		assert.deepEqual(await shipments(key), [json(answer).charge]);
		assert.equal((await lookup(key)).attempt, 1);
	} finally {
		await service.stop();
	}
});
